"""Draws the README's pictures as SVG, with nothing but the standard library.

    python docs/make_figures.py            # rewrites docs/*.svg
    python docs/make_figures.py --check    # exit 1 if a committed SVG differs from what this draws

The ring all-reduce figure is not drawn by hand: it simulates the algorithm on 4 GPUs and draws
what each GPU holds after every step. The traffic chart plots the formulas it names.
"""
import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape

DOCS = Path(__file__).resolve().parent
GPU_COLOURS = ["#e4572e", "#29a35a", "#3f6fd8", "#d9a800"]
INK, GREY, LIGHT = "#222", "#777", "#f2f2f2"


class Svg:
    def __init__(self, width, height):
        self.width, self.height, self.items = width, height, []

    def rect(self, x, y, w, h, fill="none", stroke=INK, rx=4, width=1.2, dash=None):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" rx="{rx}" fill="{fill}" '
                          f'stroke="{stroke}" stroke-width="{width}"{d}/>')

    def text(self, x, y, s, size=13, anchor="middle", colour=INK, weight="normal"):
        self.items.append(f'<text x="{x:g}" y="{y:g}" font-size="{size}" text-anchor="{anchor}" fill="{colour}" '
                          f'font-weight="{weight}">{escape(s)}</text>')

    def line(self, x1, y1, x2, y2, colour=INK, width=1.4, arrow=False, dash=None):
        a = ' marker-end="url(#arrow)"' if arrow else ""
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<line x1="{x1:g}" y1="{y1:g}" x2="{x2:g}" y2="{y2:g}" stroke="{colour}" '
                          f'stroke-width="{width}"{a}{d}/>')

    def path(self, d, colour=INK, width=1.4, arrow=False, fill="none"):
        a = ' marker-end="url(#arrow)"' if arrow else ""
        self.items.append(f'<path d="{d}" stroke="{colour}" stroke-width="{width}" fill="{fill}"{a}/>')

    def render(self):
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" font-family="Helvetica, Arial, sans-serif">\n'
                '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="context-stroke"/></marker></defs>\n'
                f'<rect width="{self.width}" height="{self.height}" fill="white"/>\n')
        return head + "\n".join(self.items) + "\n</svg>\n"


def gpu(svg, x, y, k, w=70, h=30, label=None):
    svg.rect(x, y, w, h, fill=GPU_COLOURS[k % 4] + "33", stroke=GPU_COLOURS[k % 4], width=1.6)
    svg.text(x + w / 2, y + h / 2 + 4, label or f"GPU {k}", size=12)


def data_vs_model_parallel():
    svg = Svg(760, 330)
    svg.text(190, 24, "Data parallel: a full copy of the model per GPU", weight="bold")
    svg.text(570, 24, "Model parallel: the model split over GPUs", weight="bold")
    for k in range(3):  # data parallel: each GPU the whole model, its own slice of the batch
        x = 40 + k * 110
        svg.text(x + 40, 52, f"batch slice {k}", size=11, colour=GREY)
        svg.line(x + 40, 58, x + 40, 72, arrow=True)
        gpu(svg, x + 5, 76, k)
        for layer in range(3):
            svg.rect(x + 10, 112 + layer * 30, 60, 24, fill=LIGHT)
            svg.text(x + 40, 128 + layer * 30, f"layer {layer + 1}", size=11)
    svg.path("M 50 212 C 120 248, 250 248, 310 212", arrow=True)
    svg.path("M 310 212 C 250 262, 120 262, 50 212", arrow=True)
    svg.text(190, 280, "gradients are averaged (all-reduce) every step", size=12)
    svg.text(190, 304, "FSDP (fsdp_distributed.py): data parallel too, each GPU", size=12, colour=GREY)
    svg.text(190, 320, "holding a shard of the weights, gathered layer by layer", size=12, colour=GREY)
    for k in range(3):  # model parallel: one batch goes through the GPUs in turn
        x = 440 + k * 110
        gpu(svg, x + 5, 76, k)
        svg.rect(x + 10, 142, 60, 24, fill=LIGHT)
        svg.text(x + 40, 158, f"layer {k + 1}", size=11)
        if k:
            svg.line(x - 30, 154, x + 8, 154, arrow=True)
    svg.text(412, 132, "whole batch", size=11, colour=GREY)
    svg.line(392, 154, 448, 154, arrow=True)
    svg.text(570, 220, "activations go forward, their gradients back;", size=12)
    svg.text(570, 238, "pipeline or tensor parallel (not in this repository)", size=12)
    return svg


def dataparallel_vs_ddp():
    svg = Svg(780, 330)
    svg.text(185, 24, "nn.DataParallel (dataparallel.py)", weight="bold")
    svg.rect(20, 40, 330, 262, dash="5,3", stroke=GREY)
    svg.text(185, 58, "one process, one Python interpreter (GIL)", size=11, colour=GREY)
    steps = ["1. scatter the batch, copy the model to every GPU", "2. forward in one thread per GPU",
             "3. gather outputs on GPU 0, loss on GPU 0", "4. backward: gradients summed onto GPU 0",
             "5. optimizer step on GPU 0 (copied out next step)"]
    for i, s in enumerate(steps):
        svg.text(36, 84 + i * 20, s, size=11, anchor="start")
    for k in range(4):
        gpu(svg, 36 + k * 78, 200, k)
    for k in range(1, 4):
        svg.path(f"M {71 + k * 78} 232 C {71 + k * 78} 262, 71 262, 71 234", colour=GPU_COLOURS[k], arrow=True)
    svg.text(185, 276, "GPU 0 holds the outputs, the loss and the summed", size=11)
    svg.text(185, 290, "gradients: more memory and more work than the others", size=11)
    svg.text(585, 24, "DistributedDataParallel (distributed.py)", weight="bold")
    for k in range(4):
        x, y = 410 + (k % 2) * 200, 44 + (k // 2) * 130
        svg.rect(x, y, 160, 90, dash="5,3", stroke=GREY)
        svg.text(x + 80, y + 16, f"process {k} (rank {k})", size=11, colour=GREY)
        gpu(svg, x + 45, y + 24, k)
        svg.text(x + 80, y + 74, "own forward, backward, step", size=10)
    svg.line(570, 89, 608, 89, arrow=True, colour=GPU_COLOURS[0])       # 0 -> 1
    svg.line(690, 134, 690, 172, arrow=True, colour=GPU_COLOURS[1])     # 1 -> 3
    svg.line(608, 219, 570, 219, arrow=True, colour=GPU_COLOURS[3])     # 3 -> 2
    svg.line(490, 172, 490, 134, arrow=True, colour=GPU_COLOURS[2])     # 2 -> 0
    svg.text(590, 155, "ring", size=11, colour=GREY)
    svg.text(590, 282, "gradient buckets are all-reduced while backward still runs;", size=11)
    svg.text(590, 298, "every rank then takes the same step, so the replicas stay equal", size=11)
    return svg


def ring_states(n=4):
    """Simulates ring all-reduce of a gradient cut into n chunks. Returns the states (label, holds)
    after every step, holds[gpu][chunk] = the set of GPUs whose contribution that copy contains."""
    holds = [[{g} for _ in range(n)] for g in range(n)]
    states = [("start", [[set(c) for c in row] for row in holds])]
    for step in range(n - 1):  # reduce-scatter: GPU g sends chunk (g - step) to g+1, which adds it to its own
        sent = [(g, (g - step) % n, set(holds[g][(g - step) % n])) for g in range(n)]
        for g, c, contents in sent:
            holds[(g + 1) % n][c] |= contents
        states.append((f"reduce-scatter {step + 1}", [[set(c) for c in row] for row in holds]))
    for step in range(n - 1):  # all-gather: GPU g sends its complete chunk (g + 1 - step) on, which overwrites
        sent = [(g, (g + 1 - step) % n, set(holds[g][(g + 1 - step) % n])) for g in range(n)]
        for g, c, contents in sent:
            holds[(g + 1) % n][c] = contents
        states.append((f"all-gather {step + 1}", [[set(c) for c in row] for row in holds]))
    assert all(c == set(range(n)) for row in holds for c in row)
    return states


def ring_allreduce():
    n, cell = 4, 34
    states = ring_states(n)
    svg = Svg(4 * 190 + 20, 2 * 215 + 100)
    svg.text(390, 20, "Ring all-reduce on 4 GPUs", size=13, weight="bold")
    svg.text(390, 38, "rows: GPUs 0-3; columns: the 4 chunks of each GPU's gradient; "
                      "a cell lists the GPUs whose gradients it has summed", size=11)
    for i, (label, holds) in enumerate(states[:4] + states[4:]):
        col, row = i % 4, i // 4
        x0, y0 = 20 + col * 190 + 28, 64 + row * 215
        svg.text(x0 + 2 * cell, y0, label, size=11, weight="bold" if i else "normal")
        for g in range(n):
            svg.text(x0 - 6, y0 + 14 + g * cell + cell / 2, str(g), size=10, anchor="end", colour=GPU_COLOURS[g])
            for c in range(n):
                full = len(holds[g][c]) == n
                x, y = x0 + c * cell, y0 + 14 + g * cell
                svg.rect(x, y, cell - 2, cell - 2, rx=2, fill="#bfe3c6" if full else
                         ("#fff" if len(holds[g][c]) == 1 else "#fde9c7"), stroke="#999", width=0.8)
                svg.text(x + cell / 2 - 1, y + cell / 2 + 3, "".join(map(str, sorted(holds[g][c]))), size=10)
        if i == 7:
            svg.text(x0 + 2 * cell, y0 + 14 + n * cell + 18, "done: every GPU holds the sum", size=10, colour=GREY)
    svg.text(390, 2 * 215 + 66, "Each step every GPU sends one chunk (1/4 of the gradient) to its neighbour and "
                                "receives one: 3 + 3 steps,", size=12)
    svg.text(390, 2 * 215 + 84, "2(N-1)/N of the gradient size per GPU in all, whatever the number of GPUs N",
             size=12)
    return svg


def traffic():
    svg = Svg(760, 330)
    svg.text(380, 22, "Parameter server vs ring all-reduce", weight="bold")
    # left: a server in the middle of 6 workers
    cx, cy = 130, 150
    svg.rect(cx - 40, cy - 16, 80, 32, fill="#ddd")
    svg.text(cx, cy + 4, "server", size=12)
    for k in range(6):
        a = math.pi / 2 + k * math.pi / 3
        x, y = cx + 100 * math.cos(a), cy + 95 * math.sin(a)
        gpu(svg, x - 28, y - 13, k, w=56, h=26, label=f"w{k}")
        svg.line(x - (x - cx) * 0.2, y - (y - cy) * 0.2, cx + (x - cx) * 0.45, cy + (y - cy) * 0.45, colour=GREY,
                 arrow=True)
    svg.text(cx, 290, "N gradients in, N copies of the weights out:", size=11)
    svg.text(cx, 306, "the server's link carries N x the gradient", size=11)
    # right: the chart, per-node traffic against N
    x0, y0, w, h, nmax, ymax = 330, 50, 390, 220, 16, 16
    svg.line(x0, y0 + h, x0 + w, y0 + h)
    svg.line(x0, y0 + h, x0, y0)
    for n in (1, 4, 8, 12, 16):
        x = x0 + (n - 1) / (nmax - 1) * w
        svg.line(x, y0 + h, x, y0 + h + 4)
        svg.text(x, y0 + h + 17, str(n), size=10)
    for v in (0, 2, 4, 8, 12, 16):
        y = y0 + h - v / ymax * h
        svg.line(x0 - 4, y, x0, y)
        svg.text(x0 - 7, y + 4, str(v), size=10, anchor="end")
        svg.line(x0, y, x0 + w, y, colour="#eee", width=1)
    svg.text(x0 + w / 2, y0 + h + 34, "GPUs N", size=11)
    svg.text(x0 - 34, y0 - 10, "data received per node and step, in gradient sizes", size=11, anchor="start")

    def curve(f, colour, label, ly):
        pts = [(x0 + (n - 1) / (nmax - 1) * w, y0 + h - f(n) / ymax * h) for n in range(1, nmax + 1)]
        svg.path("M " + " L ".join(f"{x:.1f} {y:.1f}" for x, y in pts), colour=colour, width=2.2)
        for x, y in pts:
            svg.items.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.6" fill="{colour}"/>')
        svg.text(x0 + w - 4, ly, label, size=11, anchor="end", colour=colour)

    curve(lambda n: n, "#c0392b", "parameter server: N (the server)", y0 + 22)
    curve(lambda n: 2 * (n - 1) / n, "#2c7a3f", "ring all-reduce: 2(N-1)/N (every GPU) -> 2", y0 + h - 44)
    return svg


# measured by benchmarks/*.py on the machine the README's Performance section names; update both together
RESULTS = {
    "input pipeline, one core (img/s)": [("(a) pytorch/examples", 426), ("(b) this repository", 854),
                                         ("(c) decode only", 1204)],
    "metric handling, cost per step (%)": [("tutorial: barrier + 3 all-reduce + .item()", 9.3),
                                           ("this repository: device sums", 0.1)],
    "distributed.py, 1 -> 2 processes (img/s)": [("1 process, --benchmark", 102), ("2 processes, --benchmark", 174),
                                                 ("1 process, whole pipeline", 103),
                                                 ("2 processes, whole pipeline", 167)],
}


def results():
    rows = sum(len(bars) + 1 for bars in RESULTS.values())
    svg = Svg(760, 40 + rows * 26)
    svg.text(380, 22, "Benchmarks (2-core CPU VM, gloo)", weight="bold")
    y = 40
    for k, (title, bars) in enumerate(RESULTS.items()):
        svg.text(20, y + 16, title, size=12, anchor="start", weight="bold")
        y += 26
        top = max(value for _, value in bars)
        for label, value in bars:
            svg.text(300, y + 14, label, size=11, anchor="end")
            svg.rect(310, y + 3, max(380 * value / top, 1), 16, fill=GPU_COLOURS[k] + "88", stroke=GPU_COLOURS[k], rx=2)
            svg.text(316 + max(380 * value / top, 1), y + 15, f"{value:g}", size=11, anchor="start")
            y += 26
    return svg


FIGURES = {"data_vs_model_parallel.svg": data_vs_model_parallel, "dataparallel_vs_ddp.svg": dataparallel_vs_ddp,
           "ring_allreduce.svg": ring_allreduce, "ps_vs_allreduce.svg": traffic, "benchmarks.svg": results}


def main(argv):
    stale = []
    for name, draw in FIGURES.items():
        text, path = draw().render(), DOCS / name
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python docs/make_figures.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
