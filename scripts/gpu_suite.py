"""The GPU acceptance suite (tests/gpu) as concurrent pytest processes, so that it fits a 10-minute call on one GPU
with 16 cores. scripts/test_gpu.sh checks the machine, then runs this with the same arguments:

    bash scripts/test_gpu.sh                            # --jobs: half the cores, at most 8
    bash scripts/test_gpu.sh --jobs 4 --time-limit 540  # 4 pytest processes; interrupt what still runs at 540 s
    bash scripts/test_gpu.sh --shard 2/3                # the second of three parts, each a call of its own
    bash scripts/test_gpu.sh --list -k fp16             # the groups it would run, and their cases
    bash scripts/test_gpu.sh -k resume -x tests/gpu/test_launchers.py   # pytest arguments pass through

It collects the cases once, cuts them (in collection order) into about three groups per job of about equal expected
cost, and runs the groups as separate pytest processes, at most --jobs at a time, the costliest first. The reference
runs that several cases compare with are made once for all of them (GPU_SUITE_SHARED: tests/gpu/harness.py's
made_once), each group has its own --basetemp and its own block of ports (TEST_PORT_BLOCK: tests/conftest.py's
free_port), and OMP_NUM_THREADS is the cores divided by the jobs. A failed group's log is printed when it ends; the
last line counts every case: "test_gpu: N passed, M failed, K skipped in X s", the wall time since test_gpu.sh
started; the cases not run (--time-limit, Ctrl-C) are listed in a file, and the line before names the command that
runs them. Exit 0 only when no case failed and every case ran."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# seconds per case (the first pattern that matches its id), what groups and shards are cut by: the mean measured on
# one H200 with 8 jobs (2026-11-26; the model cases, which now save the weights they evaluate, 2026-11-28), apex's
# cross-device cases their longest (its CPU half trains O2 in fp32)
COSTS = [(r"test_models\.py", 10), (r"test_compile_on_the_gpu", 40), (r"gives_the_bits|cuda_tensors_are_saved", 5),
         (r"cross_device.*apex", 95), (r"sigterm|cross_device|shared_gpu|multi_gpu", 25), (r"", 16)]
GROUPS_PER_JOB = 3  # more groups than jobs: a slow group then holds up one job, not the end of the run
GRACE = 30  # seconds an interrupted group has to end its launches before it is killed
# pytest options whose value is the next argument (not a test path)
VALUE_OPTIONS = {"-k", "-m", "-p", "-W", "-o", "-c", "--deselect", "--ignore", "--ignore-glob", "--basetemp",
                 "--junitxml", "--junit-xml", "--rootdir", "--maxfail", "--durations", "--confcutdir", "--timeout"}
# options that want one pytest in the foreground (what it would collect, help, a debugger): no groups then
FOREGROUND = {"--collect-only", "--co", "-h", "--help", "--fixtures", "--fixtures-per-test", "--markers",
              "--version", "-V", "--pdb", "--trace", "--setup-plan"}


def fail(message):
    print(f"test_gpu: {message}", file=sys.stderr)
    sys.exit(2)


def parse(argv):
    """This script's own options, and the rest for pytest: (options, pytest arguments, test paths)."""
    cores = len(os.sched_getaffinity(0))
    options = {"jobs": os.environ.get("GPU_SUITE_JOBS") or max(1, min(8, cores // 2)), "shard": "1/1",
               "time_limit": os.environ.get("GPU_SUITE_TIME_LIMIT") or 0, "list": False}
    rest, paths = [], []
    args = iter(argv)
    for arg in args:
        name, _, value = arg.partition("=")
        if name in ("--jobs", "--shard", "--time-limit"):
            options[name[2:].replace("-", "_")] = value if value else next(args, "")
        elif arg == "--list":
            options["list"] = True
        elif not arg.startswith("-") and (not rest or rest[-1] not in VALUE_OPTIONS) \
                and (ROOT / arg.split("::")[0]).exists():
            paths.append(arg)
        else:
            rest.append(arg)
    try:
        options["jobs"] = int(options["jobs"])
        options["time_limit"] = float(options["time_limit"])
        index, count = map(int, options["shard"].split("/"))
    except ValueError:
        fail("--jobs takes a number, --shard I/N (e.g. 2/3), --time-limit seconds")
    if options["jobs"] < 1 or not 1 <= index <= count or options["time_limit"] < 0:
        fail("--jobs takes 1 or more, --shard I/N with 1 <= I <= N, --time-limit 0 (none) or more seconds")
    options["shard"] = index, count
    return options, rest, paths


def exits_first(pytest_args):
    """-x, --exitfirst or --maxfail: stop starting groups once one has failed."""
    for arg in pytest_args:
        if arg in ("--exitfirst",) or arg.startswith("--maxfail"):
            return True
        if re.fullmatch(r"-[a-zA-Z]+", arg):
            for flag in arg[1:]:
                if flag in "rkmpWoc":  # the rest is this option's value
                    break
                if flag == "x":
                    return True
    return False


def cost(case):
    return next(seconds for pattern, seconds in COSTS if re.search(pattern, case))


def split(cases, parts):
    """`cases` cut into `parts` runs of consecutive cases of about equal cost (some may be empty)."""
    costs = [cost(case) for case in cases]
    total, done = sum(costs) or 1, 0
    groups = [[] for _ in range(parts)]
    for case, seconds in zip(cases, costs):
        groups[min(parts - 1, int(parts * (done + seconds / 2) / total))].append(case)
        done += seconds
    return groups


def collect(pytest_args, paths):
    """The ids of the selected cases, in pytest's order."""
    quiet = [arg for arg in pytest_args if not re.fullmatch(r"-[vq]+|--verbose|--quiet", arg)]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *quiet, *paths], cwd=ROOT,
                          capture_output=True, text=True)
    lines = done.stdout.split("\n\n")[0].splitlines()
    cases = list(dict.fromkeys(line for line in lines if "::" in line and not line[:1].isspace()))
    if done.returncode not in (0, 5) or (done.returncode == 0 and not cases):
        print(done.stdout + done.stderr, end="")
        fail(f"collecting the cases failed (pytest exit code {done.returncode})")
    return cases


class Group:
    def __init__(self, number, cases, folder):
        self.number, self.cases, self.cost = number, cases, sum(map(cost, cases))
        self.log, self.basetemp = folder / f"group{number}.log", folder / f"group{number}"
        self.results = folder / f"group{number}.results"
        self.proc = self.slot = self.started = self.interrupted = None
        self.outcomes = {}

    @property
    def counts(self):
        return {k: sum(o == k for o in self.outcomes.values()) for k in ("passed", "failed", "skipped", "not run")}

    def start(self, slot, pytest_args, env):
        self.slot, self.started = slot, time.monotonic()
        path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), env.get("PYTHONPATH")) if p)
        env = {**env, "TEST_PORT_BLOCK": str(slot), "GPU_SUITE_RESULTS": str(self.results), "PYTHONPATH": path}
        cmd = [sys.executable, "-m", "pytest", "-p", Path(__file__).stem, "-rfEs", *pytest_args,
               "--basetemp", self.basetemp, *self.cases]
        with open(self.log, "w") as log:  # in a session of its own: a Ctrl-C reaches it once, from run()
            self.proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def interrupt(self, grace=GRACE):
        """SIGINT, as Ctrl-C: pytest stops and its fixtures end the launches of the case it was in; after `grace`
        seconds, SIGKILL (and kill_leftovers those launches)."""
        if self.proc.poll() is None:
            if not self.interrupted:
                self.proc.send_signal(signal.SIGINT)
            self.interrupted = min(self.interrupted or time.monotonic(), time.monotonic() - GRACE + grace)

    def check(self):
        """True once it has ended (killed if it outlives its grace after an interrupt)."""
        if self.proc.poll() is None:
            if self.interrupted and time.monotonic() > self.interrupted + GRACE:
                self.proc.kill()
                self.proc.wait()
            else:
                return False
        self.outcomes = results(self.results, self.cases)
        kill_leftovers(self.proc.pid)
        return True

    @property
    def ok(self):
        return self.proc is not None and self.proc.returncode == 0 and not self.counts["not run"]

    def summary(self):
        files = sorted({case.split("::")[0] for case in self.cases})
        took = f" in {time.monotonic() - self.started:.0f} s" if self.started else ""
        return (f"group {self.number} ({len(self.cases)} cases of {', '.join(files)}): "
                f"{describe(self.counts)}{took}")


def pytest_runtest_logreport(report):
    """(This file is also a pytest plugin, which each group loads: -p gpu_suite.) Each phase of a case, as one line
    of GPU_SUITE_RESULTS."""
    with open(os.environ["GPU_SUITE_RESULTS"], "a") as results:
        results.write(json.dumps([report.nodeid, report.when, report.outcome]) + "\n")


def results(path, cases):
    """{case: passed, failed (errors in setup or teardown included), skipped, or not run (or stopped before its
    end: an interrupted case has no report of its call)}."""
    phases = {case: {} for case in cases}
    if path.exists():
        for line in path.read_text().splitlines():
            case, when, outcome = json.loads(line)
            phases.setdefault(case, {})[when] = outcome
    return {case: "failed" if "failed" in seen.values() else "skipped" if "skipped" in seen.values() else
            "passed" if seen.get("call") == "passed" else "not run" for case, seen in phases.items()}


def describe(counts):
    words = [f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "skipped")]
    return ", ".join(words + ([f"{counts['not run']} not run"] if counts.get("not run") else []))


def kill_leftovers(pid):
    """Processes a group's launches left (tests/conftest.py's Job marks them TEST_JOB=<pytest's pid>.<n>)."""
    import psutil  # test_gpu.sh checks that it is there

    for process in psutil.process_iter():
        try:
            if process.environ().get("TEST_JOB", "").startswith(f"{pid}."):
                process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def run(groups, jobs, pytest_args, time_limit, started):
    """Runs the groups, at most `jobs` at a time; returns why it stopped early ('' if it did not)."""
    threads = max(1, len(os.sched_getaffinity(0)) // jobs)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    pending, running, slots, stopped = sorted(groups, key=lambda g: -g.cost), [], list(range(jobs)), ""
    first_fail, signals = exits_first(pytest_args), []

    def stop(signum, frame):  # the first signal interrupts the groups, a second one kills them
        nonlocal stopped
        stopped = stopped or f"stopped by signal {signum}"
        signals.append(signum)
    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while running or pending and not stopped:
            if time_limit and time.monotonic() - started > time_limit:
                stopped = stopped or f"--time-limit {time_limit:.0f} s reached"
            while pending and slots and not stopped:
                group = pending.pop(0)
                group.start(slots.pop(0), pytest_args, env)
                running.append(group)
            if stopped:
                for group in running:
                    group.interrupt(grace=0 if len(signals) > 1 else GRACE)
            time.sleep(0.2)
            for group in [g for g in running if g.check()]:
                running.remove(group)
                slots.append(group.slot)
                if not group.ok:
                    print(group.log.read_text(errors="replace"), end="", flush=True)
                print(f"test_gpu: {group.summary()}", flush=True)
                if not group.ok and first_fail and not stopped:
                    stopped = "-x: a group failed"
                if group.ok:
                    shutil.rmtree(group.basetemp, ignore_errors=True)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    for group in pending:
        group.outcomes = dict.fromkeys(group.cases, "not run")
    return stopped


def main():
    started = float(os.environ.get("GPU_SUITE_T0") or time.monotonic())
    options, pytest_args, paths = parse(sys.argv[1:])
    paths = paths or ["tests/gpu"]
    if FOREGROUND & set(pytest_args):  # one plain pytest, as before the groups
        os.execv(sys.executable, [sys.executable, "-m", "pytest", "-rs", *paths, *pytest_args])
    index, count = options["shard"]
    cases = collect(pytest_args, paths)
    if not cases:
        print("test_gpu: no cases selected", file=sys.stderr)
        return 5  # as pytest
    cases = split(cases, count)[index - 1]
    jobs = options["jobs"]
    folder = Path(tempfile.mkdtemp(prefix="test_gpu-"))
    groups = [Group(n, cases_of, folder) for n, cases_of in
              enumerate((g for g in split(cases, jobs * GROUPS_PER_JOB if jobs > 1 else 1) if g), 1)]
    shard = f", shard {index}/{count}" if count > 1 else ""
    where = "" if options["list"] else f"; logs in {folder}"
    print(f"test_gpu: {len(cases)} cases{shard} in {len(groups)} groups, {jobs} at a time{where}", flush=True)
    if options["list"]:
        shutil.rmtree(folder)
        for group in groups:
            print(f"group {group.number} (expected {group.cost} s): {' '.join(group.cases)}")
        return 0
    (folder / "shared").mkdir()
    os.environ["GPU_SUITE_SHARED"] = str(folder / "shared")
    stopped = run(groups, jobs, pytest_args, options["time_limit"], started)
    failed = [line for g in groups if g.proc and not g.ok
              for line in g.log.read_text(errors="replace").splitlines() if re.match(r"(FAILED|ERROR) ", line)]
    print("\n".join(failed), end="\n" if failed else "")
    total = {k: sum(g.counts[k] for g in groups) for k in ("passed", "failed", "skipped", "not run")}
    ok = all(g.ok for g in groups) and not stopped
    if ok:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        why = f"{stopped}; " if stopped else ""
        print(f"test_gpu: {why}logs and output folders kept in {folder}")
        if total["not run"]:  # named in a file, so that the next call runs exactly these
            rest = folder / "not_run.txt"
            rest.write_text("".join(f"{c}\n" for g in groups for c, o in g.outcomes.items() if o == "not run"))
            print(f"test_gpu: the cases not run: bash scripts/test_gpu.sh $(cat {rest})")
    print(f"test_gpu: {describe(total)} in {time.monotonic() - started:.0f} s "
          f"({jobs} jobs, {len(groups)} groups{shard})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
