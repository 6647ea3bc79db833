"""The composed MNR loss, written as sentence-transformers 6.2 computes it (the
whole [B, M] similarity matrices, torch.logsumexp), for the tests: in float64
it is the oracle of nanfree's fused kernels. Shared candidates (a 2-D
`negatives`) are docs owned by no query."""

import torch
import torch.nn.functional as F

DIRECTION_BITS = {"query_to_doc": 1, "query_to_query": 2, "doc_to_query": 4, "doc_to_doc": 8}
HARDNESS = {None: 0, "in_batch_negatives": 1, "hard_negatives": 2, "all_negatives": 3}


def composed_mnr_loss(queries, positives, negatives=None, *, scale=20.0,
                      directions=("query_to_doc",), partition_mode="joint", hardness_mode=None,
                      hardness_strength=0.0, reduction="mean", offset=0, local_rows=None):
    """`queries`, `positives` (and a 3-D `negatives`) hold every rank's rows;
    rows [offset, offset + local_rows) are this rank's."""
    r = queries.shape[0]
    b = r if local_rows is None else local_rows
    docs = [positives]
    shared = None
    if negatives is not None:
        if negatives.dim() == 3:
            docs += [negatives[:, j] for j in range(negatives.shape[1])]
        else:
            shared = negatives
    owned_end = len(docs) * r
    docs_all = torch.cat(docs + ([shared] if shared is not None else []))
    m = docs_all.shape[0]
    qn = F.normalize(queries, dim=-1)
    dn = F.normalize(docs_all, dim=-1)
    device = queries.device
    g = torch.arange(offset, offset + b, device=device)
    j = torch.arange(m, device=device)
    own = (j[None, :] < owned_end) & (j[None, :] % r == g[:, None])
    sims = {"query_to_doc": qn[g] @ dn.T}
    excluded = {}
    if "query_to_query" in directions:
        sims["query_to_query"] = qn[g] @ qn.T
        excluded["query_to_query"] = torch.arange(r, device=device)[None, :] == g[:, None]
    if "doc_to_query" in directions:
        sims["doc_to_query"] = dn[g] @ qn.T
    if "doc_to_doc" in directions:
        sims["doc_to_doc"] = dn[g] @ dn.T
        excluded["doc_to_doc"] = own
    penalty = None
    if hardness_mode is not None and hardness_strength > 0:
        penalty = hardness_strength * sims["query_to_doc"].detach()
        if hardness_mode == "in_batch_negatives":
            keep = ~own
        elif hardness_mode == "hard_negatives":
            keep = own & (j[None, :] >= r)
        else:
            keep = j[None, :] != g[:, None]
        penalty = penalty * keep
    # Excluded pairs are masked after scaling: sentence-transformers masks the
    # similarities first, and -inf * scale gives a tensor scale a NaN gradient.
    logits = {k: v * scale for k, v in sims.items()}
    for k, mask in excluded.items():
        logits[k] = logits[k].masked_fill(mask, float("-inf"))
    if penalty is not None:
        logits["query_to_doc"] = logits["query_to_doc"] + penalty
    positive = logits["query_to_doc"][torch.arange(b, device=device), g]
    if penalty is not None:
        positive = positive - penalty[torch.arange(b, device=device), g]
    if partition_mode == "joint":
        log_z = torch.logsumexp(torch.cat(list(logits.values()), dim=1), dim=1)
    else:
        log_z = sum(torch.logsumexp(v, dim=1) for v in logits.values()) / len(logits)
    loss = log_z - positive
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss
