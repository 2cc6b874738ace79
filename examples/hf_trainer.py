"""hopq under the Hugging Face Trainer: a tiny GPT-2 (random weights, built from
a config; nothing is downloaded) on two CPU processes.

    torchrun --nproc_per_node 2 examples/hf_trainer.py --steps 20

``attach`` registers the hook when training begins and merges
``hopq/bits_per_coordinate`` and the rest into the Trainer's own log entries
(``loss`` stays), which reach every reporter (``--report-to tensorboard``).
"""

import argparse
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import hopq
from hopq.integrations.transformers import attach


def main(argv=None) -> list:
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="dynamiq")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="runs/examples/hf_trainer")
    p.add_argument("--report-to", default="none")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (512, 32), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    targs = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=5,
        report_to=args.report_to,
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    attach(trainer, hopq.HookState(codec=args.codec))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    print(f"rank {trainer.args.process_index}: {json.dumps(logs[-1])}")
    return logs


if __name__ == "__main__":
    main()
