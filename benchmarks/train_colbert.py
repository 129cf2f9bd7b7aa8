"""A late-interaction model to measure token pooling and MUVERA on, where no ColBERT checkpoint can be downloaded:
MiniLM (the packaged all-MiniLM-L6-v2) fine-tuned into a ColBERT with PyLate's recipe (a 128-d projection, [Q] /
[D] markers, query expansion; PyLate's contrastive loss over in-batch negatives plus one random negative per
pair) on one collection's judgments, saved in PyLate's layout for polyvec. Train on Cranfield and measure on
Vaswani, so the collection measured is not the one trained on:

    python benchmarks/train_colbert.py --out /tmp/minilm-colbert [--data cranfield] [--epochs 2]
    python benchmarks/index.py --data vaswani --model /tmp/minilm-colbert --only pool_factor int8
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import collection, hardware  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--data", default="cranfield", help="the collection whose judgments train the model")
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-5)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from pylate import losses, models, utils
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.base.modules.transformer import Transformer

    from polyvec.resolve import resolve_model_path

    sys.path.insert(0, str(HERE.parent))
    from tests.helpers import write_pylate

    torch.manual_seed(0)
    random.seed(0)
    folder = collection(args.data)
    corpus = {}
    for line in open(folder / "corpus.jsonl", encoding="utf-8"):
        d = json.loads(line)
        corpus[d["_id"]] = f"{d.get('title', '')} {d['text']}".strip()
    queries = {q["_id"]: q["text"] for q in map(json.loads, open(folder / "queries.jsonl", encoding="utf-8"))}
    relevant: dict[str, list[str]] = {}
    for line in list(open(folder / "qrels.tsv", encoding="utf-8"))[1:]:
        q, d, score = line.split("\t")[:3]
        if int(score) >= 1:
            relevant.setdefault(q, []).append(d)
    ids, rows = list(corpus), []
    for q, docs in relevant.items():
        for d in docs:
            negative = random.choice(ids)
            while negative in docs:
                negative = random.choice(ids)
            rows.append({"query": queries[q], "positive": corpus[d], "negative": corpus[negative]})
    random.shuffle(rows)

    # The bare transformer (no sentence-transformers pooling module) and PyLate's Dense, as its own checkpoints are.
    base = resolve_model_path("sentence-transformers/all-MiniLM-L6-v2")
    work = args.out.with_name(args.out.name + ".work")
    (work / "bare").mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(Path(base) / name, work / "bare")
    dense = importlib.import_module("pylate.models.Dense").Dense(in_features=384, out_features=128, bias=False)
    transformer = Transformer(str(work / "bare"))
    # sentence-transformers 6 measures a text's length through a method PyLate 1.6's ColBERT lacks
    models.ColBERT._text_length = lambda self, t: len(t) if isinstance(t, str) else sum(map(len, t))
    model = models.ColBERT(modules=[transformer, dense], device="cpu", query_length=32, document_length=180)
    training = SentenceTransformerTrainingArguments(
        output_dir=str(work / "run"), num_train_epochs=args.epochs, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, warmup_steps=0.1, logging_steps=10, save_strategy="no", seed=0, report_to="none",
        use_cpu=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = SentenceTransformerTrainer(
        model=model,
        args=training,
        train_dataset=Dataset.from_list(rows),
        loss=losses.Contrastive(model=model),
        data_collator=utils.ColBERTCollator(model.tokenize),
    )
    start = time.perf_counter()
    trainer.train()
    took = time.perf_counter() - start

    out = write_pylate(model, args.out)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{len(rows)} pairs from {args.data}, {args.epochs:g} epochs of batches of {args.batch}, trained in "
          f"{took:.0f} s on {hardware()}; saved {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
