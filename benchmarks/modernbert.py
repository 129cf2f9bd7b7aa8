"""ModernBERT speed: polyvec vs sentence-transformers vs vLLM on a ModernBERT-base-shaped model.

    python benchmarks/modernbert.py [--layers 6] [--passages 500] [--repeats 3] [--systems polyvec st vllm]
                                    [--dtypes float32 bfloat16]

No ModernBERT checkpoint can be downloaded here, so this builds one: ModernBERT-base's shape (hidden 768, 12
heads, intermediate 1152, a local window of 128, every third layer global, rope thetas 160,000 / 10,000) with
`--layers` layers (22 in the real model; fewer keeps a run short on 2 cores) and seeded weights, saved by
transformers with MiniLM's tokenizer in the sentence-transformers layout of modernbert-embed / gte-modernbert
(Transformer + mean Pooling + Normalize). Then benchmarks/throughput.py runs the systems on it, side by side
and interleaved, for embed and token_embed (passages truncated to 256 tokens, longer than the window).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(folder: Path, layers: int) -> Path:
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    from polyvec.loader import resolve_model_path

    torch.manual_seed(0)
    cfg = transformers.ModernBertConfig(
        vocab_size=30522,
        hidden_size=768,
        intermediate_size=1152,
        num_hidden_layers=layers,
        num_attention_heads=12,
        local_attention=128,
        global_attn_every_n_layers=3,
        max_position_embeddings=8192,
        pad_token_id=0,
        cls_token_id=101,
        sep_token_id=102,
        bos_token_id=101,
        eos_token_id=102,
    )
    trunk = folder / "trunk"
    transformers.ModernBertModel(cfg).save_pretrained(trunk)
    tok = resolve_model_path("sentence-transformers/all-MiniLM-L6-v2")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (trunk / name).write_bytes((tok / name).read_bytes())
    st = SentenceTransformer(
        modules=[models.Transformer(str(trunk), max_seq_length=256), models.Pooling(768, "mean"), models.Normalize()],
        device="cpu",
    )
    st.save(str(folder / "model"))
    return folder / "model"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--passages", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", nargs="+", default=["polyvec", "st", "vllm"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--folder", help="where to build the model (default: a temporary folder)")
    args = ap.parse_args()
    folder = Path(args.folder or tempfile.mkdtemp(prefix="modernbert-"))
    model = folder / "model" if (folder / "model" / "modules.json").is_file() else build(folder, args.layers)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]  # a reused folder's own
    if layers != args.layers:
        sys.exit(f"{model} has {layers} layers, not --layers {args.layers}: give another --folder or remove it")
    print(f"ModernBERT-base shape, {layers} layers, seeded weights: {model}\n", flush=True)
    cmd = [sys.executable, str(HERE / "throughput.py"), "--model", str(model), "--passages", str(args.passages)]
    cmd += ["--repeats", str(args.repeats), "--systems", *args.systems, "--dtypes", *args.dtypes]
    return subprocess.call(cmd)


if __name__ == "__main__":
    raise SystemExit(main())
