"""A 🤗 Trainer run that survives SIGKILL and SIGTERM: ``StatefulTrainer`` on a tiny GPT-2 (built from a config).

Train (any number of processes; run the same command again after a kill, it resumes exactly)::

    accelerate launch --multi_gpu --num_processes 2 examples/trainer.py OUT

``python examples/trainer.py --demo`` (``make demo-trainer``) shows it on 2 CPU processes: an uninterrupted
run, then the same run SIGKILLed after step 7 and SIGTERMed after step 15 (the launcher forwards the signal;
a checkpoint is taken at the next step and the run exits with 143), each time restarted with the same
command; every rank's batches and the loss log must equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_STEPS = 24, 4


def dataset(n: int = 96):
    """A ``datasets.Dataset`` of token rows; a row's first token is its id (so the log shows the samples)."""
    import datasets

    return datasets.Dataset.from_list([{"input_ids": [i % 90 + 2] + [(i * k) % 90 + 2 for k in range(7)]}
                                       for i in range(n)])


def collate(rows: list) -> dict:
    ids = torch.tensor([row["input_ids"] for row in rows])
    return {"input_ids": ids, "labels": ids.clone()}


def train(out: Path) -> None:
    """The user's script: a Trainer, made stateful by one import."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from accelerate_stateful.integrations.transformers import StatefulTrainer, checkpoint_step, latest_trainer_checkpoint

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=8, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=STEPS, save_steps=SAVE_STEPS, save_total_limit=2, logging_steps=1,
                             dataloader_num_workers=2, report_to=[], disable_tqdm=True, seed=0)
    rank = int(os.environ.get("RANK", "0"))
    log = open(out / f"samples.rank{rank}.jsonl", "a", buffering=1)

    class Logged(StatefulTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            ids = (inputs["input_ids"][:, 0] - 2).tolist()
            log.write(json.dumps({"step": self.state.global_step, "ids": ids}) + "\n")
            return super().training_step(model, inputs, num_items_in_batch)

    class Interruptions(TrainerCallback):
        """For the demo only: DEMO_KILL_AT / DEMO_TERM_AT, after which step to SIGKILL / SIGTERM the job."""

        def on_step_end(self, args, state, control, **kwargs):
            if str(state.global_step) == os.environ.get("DEMO_KILL_AT"):
                os.kill(os.getpid(), signal.SIGKILL)
            if str(state.global_step) == os.environ.get("DEMO_TERM_AT") and rank == 0:
                os.kill(os.getppid(), signal.SIGTERM)  # to the launcher, as a scheduler would

    trainer = Logged(model=model, args=args, train_dataset=dataset(), data_collator=collate,
                     callbacks=[Interruptions()])
    latest = latest_trainer_checkpoint(out)  # what train(resume_from_checkpoint=True) will pick
    log.write(json.dumps({"start": checkpoint_step(latest) if latest else 0}) + "\n")
    trainer.train(resume_from_checkpoint=True)  # the newest complete checkpoint-N, or a fresh start
    losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    (out / f"losses.rank{rank}.json").write_text(json.dumps(losses))


# --------------------------------------------------------------------------- the demo
def launch(out: Path, **env: str) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
               "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1", __file__, str(out)]
    full_env = {**os.environ, "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.Popen(command, env=full_env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        return proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def trained(out: Path, rank: int) -> list:
    """What rank ``rank`` trained on, over every attempt: each attempt from its start step, later ones win."""
    batches: list = []
    for line in (out / f"samples.rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "start" in record:
            batches = [b for b in batches if b["step"] < record["start"]]
        else:
            batches.append(record)
    return batches


def demo() -> int:
    base = ROOT / "demo_runs" / "trainer"
    shutil.rmtree(base, ignore_errors=True)
    reference, resumed = base / "reference", base / "resumed"
    for out in (reference, resumed):
        out.mkdir(parents=True)
    print("1. uninterrupted run on 2 processes ...", flush=True)
    print("   exit", launch(reference))
    print("2. SIGKILL after step 7 ...", flush=True)
    print("   exit", launch(resumed, DEMO_KILL_AT="7"), "(killed); newest complete checkpoint:",
          sorted(p.name for p in resumed.glob("checkpoint-*")))
    print("3. the same command: resumes, then SIGTERM to the launcher after step 15 ...", flush=True)
    print("   exit", launch(resumed, DEMO_TERM_AT="15"), "(each rank saved at the next step and exited with 143);",
          "checkpoints:", sorted(p.name for p in resumed.glob("checkpoint-*")))
    print("4. the same command again: resumes to the end ...", flush=True)
    print("   exit", launch(resumed))
    ok = True
    for rank in range(2):
        same_batches = trained(resumed, rank) == trained(reference, rank)
        same_losses = (resumed / f"losses.rank{rank}.json").read_text() == (
            reference / f"losses.rank{rank}.json").read_text()
        print(f"rank {rank}: batches {'identical' if same_batches else 'DIFFER'}, "
              f"loss log {'identical' if same_losses else 'DIFFERS'} to the uninterrupted run")
        ok = ok and same_batches and same_losses
    print("TRAINER DEMO OK" if ok else "TRAINER DEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="output folder (checkpoints, logs)")
    parser.add_argument("--demo", action="store_true", help="kill and resume a 2-process run, and compare")
    options = parser.parse_args()
    if options.demo:
        sys.exit(demo())
    options.out.mkdir(parents=True, exist_ok=True)
    train(options.out)
