"""The training loop's own flags under the real launchers: --grad-accum-steps (no_sync, one all-reduce per
optimizer step), --compile (checkpoints without `_orig_mod.`), --clip-grad-norm on the true gradients,
--label-smoothing in the training loss only, --model-ema (a reference average, bit-for-bit resume), TF32,
and --profile (torch.profiler's trace of every rank, the operators that took the most time)."""
import math
import re
import signal
import types

import pytest
import torch
import torchvision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (FAST, LAUNCHER_FAILED, LOOP, NO_BN, RESUME, assert_preempted, assert_same_loop, assert_same_run,
                      assert_same_tensors, ema_weights, import_script, load, metrics, ok, profile_traces, python, spawn,
                      torchrun)
from test_distributed import val_line

SCRIPT = "distributed.py"


def all_reduces_per_step(events):
    """How many all-reduces (DDP's buckets, the preemption flag) each profiled optimizer step made, on average."""
    steps = sum(e.get("name", "").startswith("ProfilerStep#") for e in events)
    assert steps == 3, steps
    return sum(e.get("name") == "gloo:all_reduce" for e in events) / steps


@pytest.fixture(scope="module")
def one_pass(image_data, tmp_path_factory):
    """2 processes, each batch in one pass, 3 steps profiled."""
    out = tmp_path_factory.mktemp("one_pass")
    return ok(torchrun(SCRIPT, 2, image_data, *NO_BN, "--profile", "3", "--output-dir", out)), out


@pytest.mark.xdist_group("training_loop_one_pass")
def test_grad_accum_steps_give_the_weights_of_one_pass_and_one_all_reduce_per_step(one_pass, image_data, tmp_path):
    """Each process's 8 images in 2 micro-batches of 4: the same weights, and no more all-reduces per optimizer
    step (DDP's buckets and the preemption flag) than one pass makes: no_sync holds back the first micro-batch's.
    With loader workers."""
    ok(torchrun(SCRIPT, 2, image_data, *NO_BN, "--grad-accum-steps", "2", "-j", "2", "--profile", "3",
                "--output-dir", tmp_path))
    assert_same_tensors(load(tmp_path / "checkpoint.pth.tar")["state_dict"],
                        load(one_pass[1] / "checkpoint.pth.tar")["state_dict"], exact=False)
    once, twice = (all_reduces_per_step(profile_traces(out)[0]) for out in (one_pass[1], tmp_path))
    assert once == twice >= 2, (once, twice)


@pytest.mark.xdist_group("training_loop_one_pass")
def test_profile_writes_every_ranks_trace_and_logs_the_operators_that_took_the_most_time(one_pass):
    job, out = one_pass
    assert job.output.count("profile: 3 steps, the operators that took the most time:") == 1, job.output  # rank 0's
    assert re.search(r"^ *aten::convolution_backward ", job.output, re.M), job.output  # a row of the table
    ranks = profile_traces(out)
    assert list(ranks) == [0, 1]
    for events in ranks.values():
        assert all_reduces_per_step(events) >= 2  # one step each: the gradients' and the preemption flag's
        assert any(e.get("name", "").startswith("Optimizer.step#SGD") for e in events)


@pytest.mark.parametrize("launch", ["spawn", "dataparallel", "apex O0"])
def test_every_launcher_runs_the_loop_as_distributed_py_does(launch, loop_reference, image_data, tmp_path):
    """The loop is the same text in every script (the launcher part gives it no_sync or not): spawn's DDP equals
    torchrun's bit for bit; DataParallel's one process (its global batch in 2 micro-batches) and apex's loop
    (a torch.amp GradScaler subclass, apex's fused-optimizer path) equal it to rounding."""
    if launch == "spawn":
        ok(spawn("multiprocessing_distributed.py", 2, image_data, *LOOP, "--output-dir", tmp_path))
    elif launch == "dataparallel":
        ok(python("dataparallel.py", image_data, *LOOP, "--output-dir", tmp_path))
    else:
        ok(torchrun("apex_distributed.py", 2, image_data, *LOOP, "--opt-level", "O0", "--output-dir", tmp_path))
    assert_same_loop(tmp_path, loop_reference, exact=launch == "spawn")


@pytest.mark.xdist_group("training_loop_one_pass")
def test_a_tiny_clip_threshold_changes_the_update(one_pass, image_data, tmp_path):
    ok(torchrun(SCRIPT, 2, image_data, *NO_BN, "--clip-grad-norm", "1e-4", "--output-dir", tmp_path))
    clipped, plain = (load(d / "checkpoint.pth.tar")["state_dict"] for d in (tmp_path, one_pass[1]))
    assert not torch.allclose(clipped["classifier.1.weight"], plain["classifier.1.weight"])


def loop_step(module, model, optimizer, scaler, max_norm, batch):
    """One train_step of a script on `batch` (inputs, target): forward, scaled backward, clipping, the step."""
    run = module.RunState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), scaler,
                          None)
    args = types.SimpleNamespace(grad_accum_steps=1, label_smoothing=0.0, clip_grad_norm=max_norm)
    module.train_step(run, *batch, args)


def true_gradients(model, batch):
    """The gradients of the training loss on `batch`, unscaled, in fp32, from the model's weights as they are now
    (computed apart: the model's own parameters keep no gradient)."""
    weights = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    inputs, target = batch
    loss = torch.nn.functional.cross_entropy(torch.func.functional_call(model, weights, (inputs,)), target)
    return [g.float() for g in torch.autograd.grad(loss, list(weights.values()))]


@pytest.mark.parametrize("threshold", [0.5, 2.0], ids=["clips", "does-not-clip"])
def test_clipping_sees_the_unscaled_gradients(threshold):
    """fp16's loss scale (2^10 here) multiplies every gradient: clipping before unscaling would clip always, and
    to a norm 1024 times too small. The step must equal plain SGD on the true gradients, clipped to threshold x
    their norm."""
    module = import_script(SCRIPT)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    batch = torch.randn(4, 8), torch.tensor([0, 1, 2, 1])
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    true = true_gradients(model, batch)
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in true]))
    loop_step(module, model, optimizer, scaler, threshold * norm.item(), batch)
    factor = min(threshold, 1.0)
    for p, p0, g in zip(model.parameters(), before, true):
        assert torch.allclose(p0 - p.detach(), factor * g, rtol=1e-5, atol=1e-7)


def test_apex_o2_clips_the_fp32_master_gradients():
    """apex O2: the model's gradients are bfloat16 (and loss-scaled where fp16 is); the optimizer steps fp32 master
    weights. Clipping must see the masters' unscaled fp32 gradients: the step equals SGD on them, clipped."""
    module = import_script("apex_distributed.py")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = module.MasterWeights(model, optimizer, torch.device("cpu"), enabled=True)
    masters = [master for _, master in scaler.masters.values()]
    before = [m.detach().clone() for m in masters]
    model.to(torch.bfloat16)
    batch = torch.randn(4, 8, dtype=torch.bfloat16), torch.tensor([0, 1, 2, 1])
    true = true_gradients(model, batch)  # in bfloat16 as the model computes them (the loss scale is a power of 2)
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in true]))
    loop_step(module, model, optimizer, scaler, 0.5 * norm.item(), batch)
    for master, m0, g in zip(masters, before, true):
        assert torch.allclose(m0 - master.detach(), 0.5 * g, rtol=1e-3, atol=1e-6)
    for p, master in zip(model.parameters(), masters):  # the model computes with the new masters
        assert torch.equal(p.detach(), master.detach().to(torch.bfloat16))


def test_label_smoothing_is_in_the_training_loss_only(image_data, tmp_path):
    """With --lr 0 nothing moves: the training losses differ by the smoothing alone, validation losses not at all."""
    rows = {}
    for smoothing in ("0", "0.3"):
        out = tmp_path / smoothing
        ok(python(SCRIPT, image_data, *FAST, "--lr", "0", "--epochs", "1", "--label-smoothing", smoothing,
                  "--output-dir", out))
        rows[smoothing] = metrics(out)[0]
    assert rows["0.3"]["train_loss"] != pytest.approx(rows["0"]["train_loss"], rel=1e-4)
    assert rows["0.3"]["val_loss"] == rows["0"]["val_loss"]


EMA = [*RESUME, "--model-ema", "--model-ema-decay", "0.5", "--model-ema-steps", "12"]  # 12 steps: once an epoch


def test_model_ema_is_the_average_of_the_epochs_weights_and_resumes_bit_for_bit(image_data, tmp_path):
    """One update at each epoch's end, with decay 0.5: the first copies the weights, each next one halves the way to
    them; the average is that of the three checkpoints' (parameters and rank 0's BatchNorm statistics), weighted 1/4,
    1/4, 1/2. A run resumed after every epoch ends with the uninterrupted run's average, bit for bit; the average is
    evaluated (metrics.jsonl, TensorBoard, the epoch's line)."""
    whole = ok(torchrun(SCRIPT, 2, image_data, *EMA, "--epochs", "3", "--output-dir", tmp_path / "whole"))
    weights = []
    for epochs in (1, 2, 3):
        ok(torchrun(SCRIPT, 2, image_data, *EMA, "--epochs", epochs, "--resume", "auto",
                    "--output-dir", tmp_path / "resumed"))
        weights.append(load(tmp_path / "resumed" / "checkpoint.pth.tar")["state_dict"])
    final = load(tmp_path / "whole" / "checkpoint.pth.tar")
    assert_same_tensors(load(tmp_path / "resumed" / "checkpoint.pth.tar")["model_ema"], final["model_ema"])
    assert_same_tensors(weights[-1], final["state_dict"])
    average = weights[0]
    for state in weights[1:]:  # (integer buffers, BatchNorm's step counts, cut to integers again)
        average = {k: (0.5 * v + 0.5 * state[k]).to(v.dtype) for k, v in average.items()}
    assert final["model_ema"]["n_averaged"] == 3
    assert_same_tensors(ema_weights(final), average, exact=False, rtol=1e-5, atol=1e-6)
    rows = metrics(tmp_path / "whole")
    assert all({"val_loss_ema", "val_acc1_ema", "val_acc5_ema"} <= set(row) for row in rows)
    tb = EventAccumulator(str(next((tmp_path / "whole" / "tb").iterdir()))).Reload()
    assert [e.value for e in tb.Scalars("val_acc1_ema")] == pytest.approx([r["val_acc1_ema"] for r in rows])
    assert re.search(r"^Epoch 2: .* \| ema acc1 [\d.]+ \| \d+ img/s$", whole.output, re.M), whole.output


def test_a_preempted_run_with_every_loop_flag_resumes_bit_for_bit(image_data, tmp_path):
    """SIGTERM to one rank mid-epoch, with micro-batches, clipping and an average updated every step: the run
    stops between two optimizer steps, and resumed it ends with the uninterrupted run's weights, average,
    optimizer state and metrics, bit for bit."""
    args = [image_data, *RESUME, "--epochs", "2", "--grad-accum-steps", "2", "--clip-grad-norm", "0.5",
            "--label-smoothing", "0.1", "--model-ema", "--model-ema-decay", "0.9"]
    ok(torchrun(SCRIPT, 2, *args, "--output-dir", tmp_path / "whole"))
    job = torchrun(SCRIPT, 2, *args, "--output-dir", tmp_path / "cut")
    job.wait_for_line("Epoch 0 [ 2/12]")
    job.process_of_rank(1).send_signal(signal.SIGTERM)
    step = assert_preempted(job, tmp_path / "cut", code=LAUNCHER_FAILED)
    resumed = ok(torchrun(SCRIPT, 2, *args, "--resume", "auto", "--output-dir", tmp_path / "cut"))
    assert f"(epoch 0, step {step})" in resumed.output
    assert_same_run(tmp_path / "cut", tmp_path / "whole", epochs=2)
    assert_same_tensors(load(tmp_path / "cut" / "checkpoint.pth.tar")["model_ema"],
                        load(tmp_path / "whole" / "checkpoint.pth.tar")["model_ema"])


def test_compile_trains_and_its_checkpoint_loads_into_a_plain_model_and_evaluates(image_data, tmp_path):
    """torch.compile wraps the DDP module; the checkpoint is the plain model's (no `_orig_mod.` prefix), and
    distributed.py -e evaluates it as training did. A checkpoint saved from a compiled model elsewhere (nanoGPT
    saves `_orig_mod.` keys) loads too."""
    ok(torchrun(SCRIPT, 2, image_data, *FAST, "--epochs", "1", "--compile", "-j", "2", "--output-dir",
                tmp_path / "out"), timeout=480)
    state = load(tmp_path / "out" / "checkpoint.pth.tar")["state_dict"]
    plain = torchvision.models.resnet18(num_classes=4)
    plain.load_state_dict(state)  # strict: every key, no prefix
    loss, _ = val_line(ok(python(SCRIPT, image_data, *FAST, "-e", "--resume", tmp_path / "out" / "checkpoint.pth.tar")))
    assert loss == pytest.approx(metrics(tmp_path / "out")[0]["val_loss"], rel=1e-5)
    compiled = torch.compile(plain)  # compiles nothing until called
    assert all(key.startswith("_orig_mod.") for key in compiled.state_dict())
    torch.save({"arch": "resnet18", "state_dict": compiled.state_dict()}, tmp_path / "elsewhere.pth")
    assert val_line(ok(python(SCRIPT, image_data, *FAST, "-e", "--resume", tmp_path / "elsewhere.pth")))[0] == loss


@pytest.mark.parametrize("no_tf32", [False, True])
def test_tf32_is_on_unless_no_tf32(no_tf32):
    module = import_script(SCRIPT)
    try:
        module.set_tf32(types.SimpleNamespace(no_tf32=no_tf32))
        assert torch.backends.cuda.matmul.allow_tf32 is torch.backends.cudnn.allow_tf32 is (not no_tf32)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True  # torch's defaults


@pytest.mark.quick
@pytest.mark.parametrize("flags, expected", [
    ([], lambda step: 0.1 ** (step // 4 // 3)),  # /10 every --lr-step 3 epochs of 4 steps
    (["--lr-schedule", "cosine"], lambda step: 0.5 * (1 + math.cos(math.pi * step / 40))),
    (["--warmup-epochs", "2"], lambda step: (step + 1) / 8 if step < 8 else 0.1 ** (step // 4 // 3)),
    (["--warmup-epochs", "2", "--lr-schedule", "cosine"],
     lambda step: (step + 1) / 8 if step < 8 else 0.5 * (1 + math.cos(math.pi * (step - 8) / 32))),
], ids=["step", "cosine", "warmup-step", "warmup-cosine"])
def test_the_learning_rate_follows_its_schedule_at_every_step(flags, expected):
    """lr_factor over 10 epochs of 4 steps: step decay, a cosine from 1 to 0 after the warm-up, a linear warm-up
    from 1/8 to 1 over 2 epochs; and a warm-up of 0.3 epochs (0.3 * 10 steps, which floats round up) ends at step 3,
    one shorter than a step at the first (it went above --lr: 25 times, for 0.01 epochs of 4 steps)."""
    module = import_script(SCRIPT)
    args = module.parse_args(["--epochs", "10", "--lr-step", "3", *flags])
    assert [module.lr_factor(step, 4, args) for step in range(40)] == pytest.approx([expected(s) for s in range(40)])
    short = module.parse_args([*flags, "--warmup-epochs", "0.3"])
    assert [module.lr_factor(step, 10, short) for step in (2, 3)] == pytest.approx([1.0, 1.0])
    shorter = module.parse_args([*flags, "--warmup-epochs", "0.01"])  # shorter than a step: --lr, not 25 x --lr
    assert module.lr_factor(0, 4, shorter) == 1.0
