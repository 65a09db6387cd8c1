"""Draws docs/figures/architecture.png: the data path and the save and resume paths, each box a module.

``make docs`` runs it. The module names live in :data:`MODULES` only (paths relative to the package
folder): after a module moves, change its path there and run ``make docs``. ``tests/test_docs.py`` checks
that every path named here exists, that every module of the package but its ``__init__.py`` files is drawn
(or listed in :data:`NOT_DRAWN` with a reason), and that the committed PNG shows what this script draws
(its :func:`fingerprint` is saved in the PNG).

Usage::

    python tools/architecture.py docs/figures/architecture.png
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from typing import Optional

PACKAGE = "accelerate_stateful"

# Role -> module path inside the package. The one place the figure names modules.
MODULES = {
    "accelerator": "accelerator.py",
    "context": "_context.py",
    "adapter": "loaders/_adapter.py",
    "lifecycle": "loaders/_lifecycle.py",
    "in_step": "checkpoint/_in_step.py",
    "shard": "loaders/shard.py",
    "dispatch": "loaders/dispatch.py",
    "iterable": "loaders/iterable.py",
    "stream": "loaders/_stream.py",
    "batchsampler": "loaders/batchsampler.py",
    "skip": "loaders/skip.py",
    "order": "position/_order.py",
    "position": "position/_plan.py",
    "deal": "position/_deal.py",
    "sharded": "sources/sharded.py",
    "roundrobin": "sources/roundrobin.py",
    "state": "checkpoint/_state.py",
    "files": "checkpoint/_files.py",
    "checkpoints": "checkpoint/_checkpoints.py",
    "resume": "checkpoint/_resume.py",
    "dcp": "checkpoint/dcp.py",
    "accumulation": "training/_accumulation.py",
    "rng": "training/_rng.py",
    "errors": "errors.py",
}
# Modules of the package the figure leaves out on purpose, and why. Every ``__init__.py`` is left out too:
# a front door re-exports the names the boxes show and does no step of its own.
_PLUMBING = "a helper of the box that names its package's main module"
NOT_DRAWN: dict[str, str] = {
    "cli/_shuffled.py": "a Shuffled buffer's draws replayed in item numbers, for samples; part of cli/_composed.py",
    "cli/_filtered.py": "a Filtered stream's steps as the source items they drew, from the marks its filter noted; "
                        "beside cli/_packed.py (docs/cli.md)",
    "cli/_packed_filtered.py": "a Packed(Filtered) stream's documents as the source items they were, from the "
                               "filter's draws its packer noted; part of cli/_packed.py (docs/cli.md)",
    "sources/_draws.py": "a Shuffled buffer's draws, importable without torch; part of shuffle.py",
    "sources/_recorded.py": "a position recorded after every batch, made JSON-able only when read; part of "
                            "_global.py",
    "training/_rng_prints.py": "the random and numpy states taken and set again only when they changed; part "
                               "of training/_rng.py",
    "__main__.py": "runs the command line (cli/), which reads checkpoints through checkpoint/",
    "transformers.py": "public import path of integrations/transformers.py",
    "_teardown.py": "lets gloo's threads finish before the process group is destroyed at exit",
    "_log.py": "every module's logger: lines that name the package, Accelerate's main-process logger",
    "checkpoint/_lines.py": "the lines a run prints once: where it resumed, a fresh start, data no checkpoint holds",
    "loaders/_passes.py": "a pass: the iterator the loop holds, the record the loader judges it by; " + _PLUMBING,
    "loaders/_holders.py": "names a kept exception that holds a live pass at a save; part of _lifecycle.py",
    "loaders/_putback.py": "what a save records of a live pass: its batches not trained yet put back; part of "
                           "_lifecycle.py",
    "loaders/_carried.py": "the pass a checkpoint carries and a resume goes on from (live, owed, ended inside "
                           "the loops); part of _lifecycle.py",
    "loaders/_workers.py": "stops a pass's DataLoader workers when it ends by an exception",
    "loaders/_torch_iter.py": "the base DataLoader's batches without torch's per-batch profiler annotation while "
                              "no profiler records; part of _adapter.py",
    "loaders/_broadcast.py": "the dispatcher's one broadcast per step (a batch, the end, or the reader's error); "
                             "part of dispatch.py",
    "checkpoint/_compare.py": "what every process must share at a save, compared with the elastic merge's own "
                              "function; part of _in_step.py",
    "checkpoint/_pending.py": "saved states of loaders prepared after a load, given to each when it is prepared; "
                              "part of _resume.py",
    "checkpoint/_integrity.py": "every file of a checkpoint listed, sized and hashed, and the manifest's checksum; "
                                "part of _files.py",
    "loaders/_forking.py": "warns where the interpreter cannot fork workers safely (CPython gh-112275)",
    "loaders/_channels.py": "stream workers' side channel for their snapshots; " + _PLUMBING,
    "loaders/_untracked.py": "which loaders are left to Accelerate's own prepare, with a warning; " + _PLUMBING,
    "loaders/_snapshot.py": "a dataset's own state_dict() taken in a worker; " + _PLUMBING,
    "loaders/_reading.py": "how the processes read a stream (whole, by shard, logical shards); " + _PLUMBING,
    "loaders/_workerinit.py": "a user's worker_init_fn sees the user's dataset; " + _PLUMBING,
    "loaders/_shares.py": "a stream's logical workers dealt to another num_workers; " + _PLUMBING,
    "loaders/_stream_rng.py": "a stream's own global RNG states, seeded per pass and recorded per batch; "
                              + _PLUMBING,
    "loaders/_first_batch.py": "a resumed stream's first items read again to pad its last global batch; "
                               + _PLUMBING,
    "training/_fsdp2.py": "where FSDP2 keeps the partial gradient, for training/_accumulation (docs/exactness.md)",
    "training/_deepspeed.py": "where DeepSpeed keeps the partial gradient, for training/_accumulation "
                              "(docs/exactness.md)",
    "loaders/_ordered.py": "the in_order=False refusal every variant applies",
    "position/_seeds.py": "mix_seed: seeds derived from the loader's seed, used by every box that draws",
    "position/_sampler_rng.py": "a user sampler's own RNGs reseeded per epoch, and the order's fingerprint (part of "
                                "drawing an order)",
    "position/_distributed.py": "a user's DistributedSampler as one global order (an order, drawn like the others)",
    "checkpoint/_versions.py": "refuses files of an unknown format version",
    "checkpoint/_refusals.py": "the words of a refusal (loader order, world-size-dependent samplers)",
    "checkpoint/_ownership.py": "which checkpoint folders are ours (marker, manifest) and which foreign (docs/switching.md)",
    "checkpoint/_stock.py": "resuming a stock Accelerate checkpoint, its loader positions translated (docs/switching.md)",
    "training/_agreement.py": "after an elastic load, accelerator.step and new ranks' RNGs agree",
    "training/_training.py": "training events (backward, optimizer steps) mark the passes trained on (docs/lifecycle.md)",
    "training/_preemption.py": "SIGTERM/SIGUSR1: a checkpoint at an agreed step (docs/trainer.md)",
    "integrations/transformers.py": "the 🤗 Trainer drives the same Accelerator (docs/trainer.md)",
    "integrations/_trainer_checkpoints.py": "the Trainer's checkpoint-N folders (docs/trainer.md)",
    "integrations/_trainer_stock.py": "a stock Trainer's checkpoint-N, resumed as stock Trainer does (docs/switching.md)",
    "integrations/_trainer_ahead.py": "checkpoint-N past a Trainer run's starting step, moved aside before it "
                                      "(docs/switching.md)",
    "integrations/_trainer_compat.py": "what the Trainer integration relies on inside transformers",
    "cli/_main.py": "the command line reads checkpoints through checkpoint/ (docs/cli.md)",
    "cli/_read.py": "the command line's reading of a checkpoint (docs/cli.md)",
    "cli/_report.py": "the command line's tables and JSON (docs/cli.md)",
    "cli/_loaders.py": "the command line rebuilds the other loaders to answer samples (docs/cli.md)",
    "cli/_indices.py": "a shard loader's batches as dataset indices for samples, without torch (docs/cli.md)",
    "cli/_dispatched.py": "a dispatcher's steps as dataset indices for samples, without torch (docs/cli.md)",
    "cli/_streams.py": "a Mixture stream's taken steps as the mixture's sample indices, for samples (docs/cli.md)",
    "cli/_composed.py": "each sample of a Mixture as its source and document, from saved positions (docs/cli.md)",
    "cli/_packed.py": "a Packed stream's steps as pieces of documents, from the marks its packer noted "
                      "(docs/cli.md)",
    "loaders/_refetch.py": "an epoch's first batches fetched again as its pass fetched them, the padding of a "
                           "dispatcher moved by seek; part of dispatch.py",
    "cli/_diff.py": "the command line's diff (docs/cli.md)",
    "cli/_carry.py": "the command line's size of a carried gradient, without torch (docs/cli.md)",
    "cli/_check_resume.py": "check-resume runs the user's command, kills and resumes it (docs/check-resume.md)",
    "cli/_stitch.py": "check-resume's records stitched across resumes and compared (docs/check-resume.md)",
    "training/_record.py": "what each step trained on, recorded only under check-resume (docs/check-resume.md)",
    "training/_record_switch.py": "check-resume's record switch and lines, without torch; part of _record.py",
    "training/_check_workers.py": "check-resume --workers: the DataLoader workers a run is prepared with",
    "cli/_across.py": "check-resume --processes: records compared all ranks together (docs/check-resume.md)",
    "cli/_check_verdict.py": "check-resume's verdict in words; part of _check_resume.py",
    "cli/_kill_points.py": "check-resume --at: steps and named moments, found in the records; part of _check_resume.py",
    "cli/_check_setup.py": "check-resume: each run's command, processes and workers; part of _check_resume.py",
    "cli/_jobtree.py": "check-resume: every process of a run (each rank's own session too), killed and waited for; "
                       "part of _check_resume.py",
    "cli/_position.py": "a saved map-style position's length, progress and refusals, without torch (docs/cli.md)",
    "position/_saved.py": "a saved shard position's plan and check, shared by the shard loader and the command line",
    "position/_skips.py": "samples left out of an epoch's order (skip_samples), shared by the shard loader, the "
                          "dispatcher and the command line",
    "sources/_merge.py": "merging logical-shard positions and a packer's marks, shared by the loaders and the "
                         "command line",
    "sources/packed.py": "Packed, a composable source (a global sequence) read by the stream loader's box "
                         "(docs/sources/packing.md)",
    "sources/shuffle.py": "Shuffled and exact_shuffle, composable sources read by the stream loader's box "
                          "(docs/sources/shuffle.md)",
    "sources/_shuffle_hf.py": "exact_shuffle's replay of a datasets shuffle buffer; " + _PLUMBING,
    "sources/_hf_streams.py": "a datasets stream with shuffle buffers, read at prepare with each buffer replayed; " + _PLUMBING,
    "sources/filtered.py": "Filtered, a composable source (a global sequence) read by the stream loader's box "
                           "(docs/sources/filter.md)",
    "sources/indexed.py": "Indexed, an object-store StreamingDataset read by index as a map-style dataset by the "
                          "shard loader's box (docs/sources/streaming.md)",
    "sources/_hf_filters.py": "a datasets filter() that reads whole Arrow tables, given rows one at a time; "
                              + _PLUMBING,
    "sources/_global.py": "GlobalStream, the base of the composable sources (Mixture); read by the stream "
                          "loader's box",
    "sources/mixture.py": "Mixture, a composable source (a global sequence) read by the stream loader's box "
                          "(docs/sources/mixture.md)",
    "sources/_mixture_draw.py": "a Mixture's draws and weight schedule; " + _PLUMBING,
    "sources/_mixture_state.py": "a Mixture's saved position and its checks; " + _PLUMBING,
    "sources/schedule.py": "Stages and Ramp, a Mixture's weights as a function of the sample index "
                           "(docs/sources/mixture.md)",
    "loaders/_agree.py": "GlobalStream.agree: a composable source's shares agree at each pass start; " + _PLUMBING,
    "loaders/_stream_skips.py": "a composable source's items left out (skip_samples), put into each share's "
                                "start; " + _PLUMBING,
    "loaders/_frontier.py": "a composable source's epoch dealt again from the first item no share handed out, on "
                            "another number of workers or another batch; " + _PLUMBING,
}

DATA, SAVE, RESUME, NOTE = "#dbe9f6", "#e3f1df", "#fbe8d3", "#f2f2f2"


@dataclass(frozen=True)
class Box:
    """A box: its centre, size, what happens there, and the modules that do it (keys of ``MODULES``)."""

    x: float
    y: float
    w: float
    h: float
    title: str
    modules: tuple = ()
    color: str = DATA
    caption: Optional[str] = None  # instead of modules, for what is not ours (the user's code)

    def label(self) -> str:
        return self.caption if self.caption is not None else "  ".join(MODULES[key] for key in self.modules)


VARIANTS = [  # (title, modules): one per loader variant, in the order prepare() tries them
    ("DispatchDataLoader: dispatch_batches", ("dispatch",)),
    ("RoundRobinLoader: RoundRobinDataset", ("roundrobin",)),
    ("IterableShardDataLoader: IterableDataset", ("iterable", "stream", "sharded")),
    ("BatchSamplerDataLoader: a user's batch_sampler", ("batchsampler", "deal")),
    ("ShardDataLoader: map-style", ("shard", "order", "position")),
    ("SkipDataLoader: skip_first_batches", ("skip",)),
]


def boxes() -> tuple[list[Box], list[tuple[Box, Box, str]]]:
    """Every box and every arrow ``(from, to, style)`` of the figure, in data coordinates (148 x 86)."""
    user = Box(11, 66, 19, 9, "your DataLoader", caption="torch.utils.data")
    prepare = Box(38, 66, 28, 9, "Accelerator.prepare", ("accelerator", "context"))
    variants = [Box(87, 78 - 5.6 * i, 56, 4.8, title, modules) for i, (title, modules) in enumerate(VARIANTS)]
    loop = Box(136.5, 66, 22, 9, "batches, in order", caption="your training loop")
    columns = (17.5, 55.5, 93.5, 131.5)
    save = [
        Box(columns[0], 38, 33, 9, "save_state(): ranks in step", ("accelerator", "in_step"), SAVE),
        Box(columns[1], 38, 33, 9, "loader.state_dict()", ("lifecycle", "state"), SAVE),
        Box(columns[2], 38, 33, 9, "JSON + safetensors per rank", ("files",), SAVE),
        Box(columns[3], 38, 33, 9, "manifest, written last", ("checkpoints",), SAVE),
    ]
    resume = [
        Box(columns[0], 14, 33, 9, "resume()", ("accelerator",), RESUME),
        Box(columns[1], 14, 33, 9, "newest complete checkpoint", ("resume",), RESUME),
        Box(columns[2], 14, 33, 9, "validation", ("state", "adapter"), RESUME),
        Box(columns[3], 14, 33, 9, "load_state_dict()", ("adapter",), RESUME),
    ]
    notes = [
        Box(27, 3, 50, 4.5, "with torch.distributed.checkpoint instead", ("dcp",), NOTE),
        Box(82, 3, 54, 4.5, "partial gradients and pipeline RNG", ("accumulation", "rng"), NOTE),
        Box(132, 3, 30, 4.5, "every refusal", ("errors",), NOTE),
    ]
    arrows = [(user, prepare, "-")] + [(prepare, v, "-") for v in variants] + [(v, loop, "-") for v in variants]
    arrows += [(a, b, "-") for a, b in zip(save, save[1:])] + [(a, b, "-") for a, b in zip(resume, resume[1:])]
    arrows.append((save[-1], resume[1], "--"))
    return [user, prepare, *variants, loop, *save, *resume, *notes], arrows


def fingerprint() -> str:
    """What the figure says (every box's title and modules), hashed: saved in the PNG to tell a stale one."""
    said = [(box.title, box.label()) for box in boxes()[0]]
    return hashlib.sha256(json.dumps(said).encode()).hexdigest()[:16]


def draw(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=(14.8, 8.6))
    ax.set_xlim(-1, 149.5)
    ax.set_ylim(0, 86)
    ax.axis("off")
    all_boxes, arrows = boxes()
    for box in all_boxes:
        ax.add_patch(FancyBboxPatch((box.x - box.w / 2, box.y - box.h / 2), box.w, box.h,
                                    boxstyle="round,pad=0.3,rounding_size=1", facecolor=box.color,
                                    edgecolor="#555555", linewidth=1))
        small = box.h < 6
        ax.text(box.x, box.y + (0.9 if small else 1.6), box.title, ha="center", va="center",
                fontsize=9 if small else 10, weight="bold")
        base = 8 if small else 9
        fits = box.w * 8.3 / base  # monospace characters that fit across the box at this size
        ax.text(box.x, box.y - (1.2 if small else 1.9), box.label(), ha="center", va="center",
                fontsize=min(base, base * fits / len(box.label())), family="monospace", color="#333333")
    for start, end, style in arrows:
        vertical = style == "--"  # from one row down to another: leave by the bottom, enter by the top
        ax.add_patch(FancyArrowPatch(_edge(start, end, vertical), _edge(end, start, vertical), arrowstyle="-|>",
                                     mutation_scale=12,
                                     linestyle=style, color="#444444", linewidth=1, shrinkA=2, shrinkB=2))
    for y, text in ((83.5, "Data path"), (46, "Save path"), (22, "Resume path")):
        ax.text(1, y, text, fontsize=13, weight="bold", color="#222222")
    ax.text(87, 45.4, "each variant is a DataLoaderAdapter (" + MODULES["adapter"] + "): state template; its passes' "
            "lifecycle in " + MODULES["lifecycle"],
            ha="center", fontsize=8.5, style="italic", color="#333333")
    ax.text(148, -1.5, f"module paths are relative to {PACKAGE}/; drawn by tools/architecture.py",
            ha="right", fontsize=7.5, color="#666666")
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None, "Description": fingerprint()})
    plt.close(fig)


def _edge(box: Box, toward: Box, vertical: bool = False) -> tuple[float, float]:
    """Where an arrow from ``box`` toward ``toward`` leaves it: a side when they sit side by side, else top/bottom."""
    dx, dy = toward.x - box.x, toward.y - box.y
    if not vertical and abs(dx) >= (box.w + toward.w) / 2:
        return box.x + (box.w / 2 + 0.4) * (1 if dx > 0 else -1), box.y
    return box.x, box.y + (box.h / 2 + 0.4) * (1 if dy > 0 else -1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    draw(sys.argv[1])
