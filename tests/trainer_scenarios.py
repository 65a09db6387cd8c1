"""Trainer, TRL and hand-written-loop runs killed and resumed, for ``tests/test_trainer_mp.py``.

Run as ``accelerate launch ... trainer_scenarios.py OUT SET``. Every launch is the same command: it goes
through the scenarios of ``SET`` in order; a scenario first trains uninterrupted (the reference), then
trains with ``resume_from_checkpoint=True`` (or ``accelerator.resume()``) until its interruption ends
the launch: SIGKILL of every rank at a step, SIGKILL of the main process inside a save (before the
completeness marker), SIGTERM sent to the launcher (which forwards it to each rank's process group,
DataLoader workers included), or SIGUSR1 to one rank only. The next launch resumes it; once a scenario
ran to the end it is marked done and the next one starts. Every rank logs each batch it trains on
(``step``, sample ids) and the loss log, flushed line by line, so a killed attempt leaves its record.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from streams import _Cursor  # the script's folder is on sys.path, under the launcher too

V, BASE = 64, 60  # vocabulary; a sample id is written as its first two tokens (2 + id // BASE, 2 + id % BASE)


def encode(i: int, length: int) -> list[int]:
    return [2 + i // BASE, 2 + i % BASE] + [2 + (i * 7 + k) % BASE for k in range(length - 2)]


def decode(input_ids: torch.Tensor) -> list[int]:
    return ((input_ids[:, 0] - 2) * BASE + (input_ids[:, 1] - 2)).tolist()


def length_of(i: int) -> int:
    return 4 + (i * 5) % 5  # 4..8 tokens: group_by_length has something to group


class Items(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": encode(i, length_of(i))}


class Stream(_Cursor, IterableDataset):
    """A stateful stream: every rank's workers share the ids (i % workers), resuming from a position."""

    def __init__(self, n: int) -> None:
        self.n, self.pos, self.epoch = n, 0, 0

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        mine = [i for i in range(self.n) if i % workers == worker]
        mine = mine[self.epoch % len(mine):] + mine[: self.epoch % len(mine)]
        while self.pos < len(mine):
            i = mine[self.pos]
            self.pos += 1
            yield {"input_ids": encode(i, 8)}


def collate(features: list[dict]) -> dict:
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[row, : len(f["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hf_table(n: int):
    import datasets

    return datasets.Dataset.from_list([{"input_ids": encode(i, length_of(i))} for i in range(n)])


def hf_stream(n: int):
    import datasets

    rows = [{"input_ids": encode(i, 8)} for i in range(n)]
    return datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=4)


def tiny_model(kind: str = "gpt2"):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2,
                                            max_position_embeddings=16, attention_dropout=0.1))
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def tiny_tokenizer():
    """A word-level tokenizer built here (no download): token ``t<k>`` is id ``k``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{k}": k for k in range(2, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


# --------------------------------------------------------------------------- scenarios
# interruption: (kind, step). "kill": SIGKILL every rank after that optimizer step; "save": SIGKILL the main
# process inside the save of checkpoint-<step>, before its marker; "term": SIGTERM to the launcher after that
# step; "usr1": SIGUSR1 to the last rank only after that step.
SETS: dict[str, list[dict]] = {
    "world2": [
        # Uninterrupted: the source of the elastic scenario's 2-process checkpoint.
        dict(sid="map-epochs", data="map", n=40, bs=2, ga=1, workers=0, epochs=2, save_steps=3, limit=3),
        dict(sid="hf-grouped-ga4", data="hf", n=48, bs=2, ga=4, workers=2, max_steps=9, save_steps=2,
             group=True, stop=("term", 5)),
        dict(sid="stream-2pass", data="stream", n=24, bs=2, ga=1, workers=2, max_steps=14, save_steps=4,
             stop=("save", 12)),
        dict(sid="hfstream-ga4", data="hfstream", n=64, bs=2, ga=4, workers=0, max_steps=6, save_steps=2,
             stop=("usr1", 3)),
        dict(sid="sft-llama", data="sft", n=40, bs=2, ga=2, workers=0, epochs=2, save_steps=3, stop=("kill", 8)),
        dict(sid="loop-term", data="loop", n=40, bs=2, ga=2, workers=2, epochs=2, save_steps=4, stop=("term", 7)),
    ],
    "world1": [
        dict(sid="map-ga4-epoch3", data="map", n=24, bs=2, ga=4, workers=2, epochs=3, save_steps=2, stop=("kill", 7)),
        dict(sid="elastic-from-2", data="elastic", source="map-epochs", checkpoint=15),
    ],
}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Recorder:
    """Appends this rank's records of one attempt to a JSON-lines file, flushed at once."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)

    def write(self, **record: Any) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


def train_dataset(cfg: dict) -> Any:
    return {"map": Items, "sft": hf_table, "hf": hf_table, "stream": Stream, "hfstream": hf_stream,
            "loop": Items}[cfg["data"]](cfg["n"])


def make_trainer(cfg: dict, out: Path, rec: Recorder) -> Any:
    from transformers import TrainingArguments

    from accelerate_stateful.integrations.transformers import StatefulTrainer, stateful

    settings = dict(
        output_dir=str(out), per_device_train_batch_size=cfg["bs"], gradient_accumulation_steps=cfg["ga"],
        dataloader_num_workers=cfg["workers"], save_strategy="steps", save_steps=cfg["save_steps"],
        save_total_limit=cfg.get("limit", 2), logging_steps=1, report_to=[], seed=0, learning_rate=1e-3, disable_tqdm=True,
        max_steps=cfg.get("max_steps", -1), num_train_epochs=cfg.get("epochs", 1),
        train_sampling_strategy="group_by_length" if cfg.get("group") else "random",
    )
    if cfg["data"] == "sft":
        from trl import SFTConfig, SFTTrainer

        base, args = stateful(SFTTrainer), SFTConfig(max_length=16, bf16=False, **settings)
        extra = dict(processing_class=tiny_tokenizer())
        model = tiny_model("llama")
    else:
        base, args = StatefulTrainer, TrainingArguments(**settings)
        extra = dict(data_collator=collate)
        model = tiny_model()

    class Recording(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            rec.write(step=self.state.global_step, ids=decode(inputs["input_ids"].cpu()))
            return super().training_step(model, inputs, num_items_in_batch)

    return Recording(model=model, args=args, train_dataset=train_dataset(cfg), **extra)


def interrupt(cfg: dict, step: int, trainer_dir: Path) -> None:
    """Bring about the scenario's interruption after optimizer step ``step`` (a no-op at other steps)."""
    kind, at = cfg["stop"]
    if step != at:
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "term" and rank() == 0:
        os.kill(os.getppid(), signal.SIGTERM)  # the launcher, which forwards it to every rank's process group
    elif kind == "usr1" and rank() == int(os.environ["WORLD_SIZE"]) - 1:
        os.kill(os.getpid(), signal.SIGUSR1)


def kill_inside_save(cfg: dict) -> None:
    """SIGKILL the main process in the save of ``checkpoint-<step>``, after every other file, before the marker."""
    from accelerate_stateful.checkpoint import _files

    original = _files.write_manifest

    def write_manifest(checkpoint, **kwargs):
        if Path(checkpoint).name == f"checkpoint-{cfg['stop'][1]}":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(checkpoint, **kwargs)

    _files.write_manifest = write_manifest


def run_trainer(cfg: dict, out: Path, rec: Recorder, interrupted: bool) -> dict:
    from transformers import TrainerCallback

    trainer = make_trainer(cfg, out, rec)
    if interrupted:
        class Interrupt(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                interrupt(cfg, state.global_step, out)

        trainer.add_callback(Interrupt())
        if cfg["stop"][0] == "save":
            kill_inside_save(cfg)
    from accelerate_stateful.integrations.transformers import checkpoint_step, latest_trainer_checkpoint

    latest = latest_trainer_checkpoint(out)
    rec.write(start=0 if latest is None else checkpoint_step(latest))
    trainer.train(resume_from_checkpoint=True)
    losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    return {"losses": losses, "global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
            "lr": trainer.lr_scheduler.get_last_lr()[0]}


def run_loop(cfg: dict, out: Path, rec: Recorder, interrupted: bool) -> dict:
    """A hand-written Accelerate loop with the one-line preemption opt-in."""
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader

    from accelerate_stateful import Accelerator

    accelerator = Accelerator(
        gradient_accumulation_steps=cfg["ga"],
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, data_seed=0),
        project_config=ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True, total_limit=2),
    )
    set_seed(0)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Items(cfg["n"]), batch_size=cfg["bs"], shuffle=True, collate_fn=collate,
                        num_workers=cfg["workers"])
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.resume()
    accelerator.checkpoint_on_preemption()  # the one line
    step = (loader.epoch * len(loader) + loader.batches_yielded) // cfg["ga"]  # optimizer steps taken
    rec.write(start=step)
    for _ in range(loader.epoch, cfg["epochs"]):
        for batch in loader:
            with accelerator.accumulate(model):
                rec.write(step=step, ids=decode(batch["input_ids"].cpu()))
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # logged before the step: a preemption checkpoint ends the step
                    rec.write(step=step, loss=accelerator.reduce(loss.detach(), "mean").item())
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % cfg["save_steps"] == 0:
                    accelerator.save_state()
                if interrupted:
                    interrupt(cfg, step, out)
    return {"global_step": step}


def run_elastic(cfg: dict, root: Path, sdir: Path, rec: Recorder) -> dict:
    """Continue a checkpoint another scenario wrote on 2 processes, on this launch's number of processes."""
    import shutil

    source = next(c for c in SETS["world2"] if c["sid"] == cfg["source"])
    out = sdir / "out"
    if rank() == 0:
        shutil.copytree(root / cfg["source"] / "ref_out" / f"checkpoint-{cfg['checkpoint']}",
                        out / f"checkpoint-{cfg['checkpoint']}")
    trainer = make_trainer(source, out, rec)
    rec.write(start=cfg["checkpoint"])
    trainer.train(resume_from_checkpoint=True)
    return {"global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
            "lr": trainer.lr_scheduler.get_last_lr()[0], "max_steps": trainer.state.max_steps}


def run_scenario(cfg: dict, root: Path) -> None:
    import torch.distributed as dist

    sdir = root / cfg["sid"]
    sdir.mkdir(parents=True, exist_ok=True)
    r = rank()
    if cfg["data"] == "elastic":
        with open(sdir / f"result.rank{r}.json", "w") as f:
            json.dump(run_elastic(cfg, root, sdir, Recorder(sdir / f"attempt0.rank{r}.jsonl")), f)
        return
    runner = run_loop if cfg["data"] == "loop" else run_trainer
    if not (sdir / f"reference.rank{r}.json").exists():
        result = runner(cfg, sdir / "ref_out", Recorder(sdir / f"reference.rank{r}.jsonl"), False)
        (sdir / f"reference.rank{r}.json").write_text(json.dumps(result))
    if "stop" not in cfg:
        (sdir / f"result.rank{r}.json").write_text(json.dumps(result))
        return
    attempt = sum(1 for _ in sdir.glob(f"attempt*.rank{r}.jsonl"))
    rec = Recorder(sdir / f"attempt{attempt}.rank{r}.jsonl")
    try:
        result = runner(cfg, sdir / "out", rec, interrupted=attempt == 0)
    except SystemExit as exc:
        rec.write(exit=exc.code)
        raise
    (sdir / f"result.rank{r}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()


def main(root: Path, set_name: str) -> None:
    for cfg in SETS[set_name]:
        if not (root / cfg["sid"] / f"result.rank{rank()}.json").exists():
            mp_harness_rank.set_aside()
            run_scenario(cfg, root)
    (root / f"{set_name}.finished.rank{rank()}").touch()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import mp_harness_rank

    mp_harness_rank.run(main, Path(sys.argv[1]), sys.argv[2])
