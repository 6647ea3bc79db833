"""Modules wrapping nanfree.ops, drop-in for their torch.nn counterparts (and,
for the MNR losses, for sentence-transformers' loss modules)."""

import functools
import math
import sys
import warnings

import torch

from . import ops
from ._ops import mnr as _mnr
from ._ops.common import check_dim_type, is_number

__all__ = ["Softmax", "LogSoftmax", "CosineSimilarity", "GeM", "GeMTokenPooling",
           "MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss", "MNRLoss",
           "BCEWithLogitsLoss", "BCELoss", "CrossEntropyLoss", "KLDivLoss", "SigmoidFocalLoss"]
# Also CachedMultipleNegativesRankingLoss and CachedMultipleNegativesSymmetricRankingLoss
# (module __getattr__ below), left out of __all__: a star import must not need
# sentence-transformers.


def _check_positive(module, name, value, allow_zero=False):
    """A finite number > 0 (>= 0 with allow_zero), else ValueError naming the
    module and the argument, when the module is constructed."""
    if not is_number(value):
        raise TypeError(f"nanfree.nn.{module}: `{name}` must be a number, got "
                        f"{type(value).__name__}")
    low_ok = value >= 0 if allow_zero else value > 0
    if not (low_ok and math.isfinite(value)):  # also refuses NaN
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"nanfree.nn.{module}: `{name}` must be finite and {bound}, got {value}")


def _check_module_dim(module, dim):
    """A module's dim: None (torch's deprecated implicit dim, chosen per call) or an
    int (checked before torch's own check, whose words name no module)."""
    if dim is not None:
        check_dim_type(f"nn.{module}", dim)


class Softmax(torch.nn.Softmax):
    """``torch.nn.Softmax(dim)`` without NaN (a subclass: isinstance checks for
    torch's module still match); ``forward`` also takes ``mask=``."""

    def __init__(self, dim: int | None = None) -> None:
        _check_module_dim(type(self).__name__, dim)
        super().__init__(dim)

    def forward(self, input: torch.Tensor, *, mask=None) -> torch.Tensor:
        return ops.softmax(input, self.dim, _stacklevel=5, mask=mask)


class LogSoftmax(torch.nn.LogSoftmax):
    """``torch.nn.LogSoftmax(dim)`` without NaN (a subclass, as Softmax);
    ``forward`` also takes ``mask=``."""

    def __init__(self, dim: int | None = None) -> None:
        _check_module_dim(type(self).__name__, dim)
        super().__init__(dim)

    def forward(self, input: torch.Tensor, *, mask=None) -> torch.Tensor:
        return ops.log_softmax(input, self.dim, _stacklevel=5, mask=mask)


class CosineSimilarity(torch.nn.CosineSimilarity):
    """``torch.nn.CosineSimilarity(dim, eps)`` with nanfree's cosine_similarity (a
    subclass, as Softmax)."""

    def __init__(self, dim: int = 1, eps: float = 1e-8) -> None:
        check_dim_type("nn.CosineSimilarity", dim)
        # eps 0 is accepted, as torch's module does (the op then uses the
        # smallest normal number; a zero vector still gives 0).
        _check_positive("CosineSimilarity", "eps", eps, allow_zero=True)
        super().__init__(dim, eps)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return ops.cosine_similarity(x1, x2, self.dim, self.eps)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"


def _gem_p(module, p: float, eps: float, learnable: bool):
    """The module's p (checked as the functional op checks a Python p, and, for a
    learnable one, inside the range the op clamps a tensor p to), after eps."""
    _check_positive(module, "eps", eps)
    _check_positive(module, "p", p)
    if learnable:
        if not 1e-2 <= p <= 1e2:
            raise ValueError(f"nanfree.nn.{module}: a learnable `p` must lie in [0.01, 100], "
                             f"the range the op clamps a tensor p to (beyond it p would not "
                             f"learn), got {p}; pass learnable=False for a fixed p")
        # As cirtorch keeps it: Parameter(torch.ones(1) * p).
        return torch.nn.Parameter(torch.ones(1) * p)
    return float(p)


class GeM(torch.nn.Module):
    """GeM pooling of images (cirtorch's ``GeM``): ``[B, C, H, W] -> [B, C, 1, 1]``.
    With ``learnable=True`` (the default), ``p`` is a ``Parameter`` of shape [1]."""

    def __init__(self, p: float = 3.0, eps: float = 1e-6, learnable: bool = True) -> None:
        super().__init__()
        self.p = _gem_p("GeM", p, eps, learnable)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gem_pool2d(x, self.p, self.eps)

    def extra_repr(self) -> str:
        p = self.p.item() if isinstance(self.p, torch.Tensor) else self.p
        return f"p={p:.4f}, eps={self.eps}"


class GeMTokenPooling(torch.nn.Module):
    """GeM pooling of token embeddings ``[B, L, H] -> [B, H]`` over the tokens an
    ``attention_mask`` ``[B, L]`` keeps (nonzero = keep); a sequence with no kept
    token pools to 0 with gradient 0."""

    def __init__(self, p: float = 3.0, eps: float = 1e-6, learnable: bool = True) -> None:
        super().__init__()
        self.p = _gem_p("GeMTokenPooling", p, eps, learnable)
        self.eps = eps

    def forward(self, token_embeddings: torch.Tensor, attention_mask=None) -> torch.Tensor:
        mask = None if attention_mask is None else attention_mask[..., None]
        return ops.gem(token_embeddings, self.p, 1, self.eps, mask=mask)

    def extra_repr(self) -> str:
        p = self.p.item() if isinstance(self.p, torch.Tensor) else self.p
        return f"p={p:.4f}, eps={self.eps}"


# --- MNR (multiple negatives ranking / InfoNCE) losses ----------------------------

_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
_HARDNESS_MODES = (None, "in_batch_negatives", "hard_negatives", "all_negatives")


def _check_mnr_config(module, scale, directions, partition_mode, hardness_mode,
                      hardness_strength):
    """The constructor checks of sentence-transformers' MultipleNegativesRankingLoss
    (same exception type, same meaning), naming the class; returns the
    directions as a tuple."""
    def fail(error, message):
        return error(f"nanfree.nn.{module}: {message}")

    if not isinstance(scale, torch.Tensor):
        if not is_number(scale):
            raise fail(TypeError, f"`scale` must be a number or a tensor, got "
                                  f"{type(scale).__name__}")
        if not scale > 0:  # also refuses a NaN scale
            raise fail(ValueError, f"`scale` must be positive, got {scale}")
    if isinstance(directions, str):
        raise fail(ValueError, f"`directions` must be a tuple of direction names, got the "
                               f"string {directions!r}; write ({directions!r},)")
    try:
        directions = tuple(directions)
    except TypeError:
        raise fail(TypeError, f"`directions` must be a tuple of direction names, got "
                              f"{directions!r}") from None
    if not directions:
        raise fail(ValueError, "`directions` is empty: give at least 'query_to_doc'")
    unknown = [d for d in directions if not isinstance(d, str) or d not in _DIRECTIONS]
    if unknown:
        raise fail(ValueError, f"unknown `directions` {unknown}; the directions are "
                               f"{list(_DIRECTIONS)}")
    if "query_to_doc" not in directions:
        raise fail(ValueError, "`directions` must include 'query_to_doc', the direction that "
                               "scores each query's positive")
    if not isinstance(partition_mode, str) or partition_mode not in ("joint", "per_direction"):
        raise fail(ValueError, f"`partition_mode` is 'joint' or 'per_direction', got "
                               f"{partition_mode!r}")
    if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(directions):
        raise fail(ValueError, "partition_mode='per_direction' needs the positive pair among "
                               "the candidates of every direction, and 'query_to_query' / "
                               "'doc_to_doc' never hold it; use partition_mode='joint' with "
                               "these directions")
    if not (hardness_mode is None or isinstance(hardness_mode, str)) or \
            hardness_mode not in _HARDNESS_MODES:
        raise fail(ValueError, f"`hardness_mode` must be one of {list(_HARDNESS_MODES)}, got "
                               f"{hardness_mode!r}")
    if not is_number(hardness_strength):
        raise fail(TypeError, f"`hardness_strength` must be a number, got "
                              f"{type(hardness_strength).__name__}")
    if not hardness_strength >= 0.0:  # also refuses NaN
        raise fail(ValueError, f"`hardness_strength` must be non-negative, got "
                               f"{hardness_strength}")
    if hardness_mode is not None and hardness_strength == 0.0:
        warnings.warn(f"hardness_mode={hardness_mode!r} has no effect with hardness_strength=0.0; "
                      "give hardness_strength a positive value to weight hard negatives",
                      UserWarning, stacklevel=3)
    return directions


def _unique(directions):
    return tuple(dict.fromkeys(directions))


def _is_cosine(similarity_fct):
    """Whether `similarity_fct` is a cosine-similarity matrix function the fused
    loss computes itself: nanfree.ops.cos_sim or sentence_transformers.util.cos_sim
    (looked up only if sentence-transformers is already imported: a user who
    passes its cos_sim has imported it)."""
    if similarity_fct is ops.cos_sim:
        return True
    st_util = sys.modules.get("sentence_transformers.util")
    return st_util is not None and similarity_fct is getattr(st_util, "cos_sim", None)


def _similarity_name(similarity_fct):
    """The config-dict name of a similarity function: sentence-transformers' own
    rendering when it is imported, else the function's name (with a partial's
    keywords)."""
    st_util = sys.modules.get("sentence_transformers.util")
    render = getattr(st_util, "similarity_fct_name", None)
    if render is not None:
        return render(similarity_fct)
    if isinstance(similarity_fct, functools.partial):
        name = getattr(similarity_fct.func, "__name__", type(similarity_fct.func).__name__)
        keywords = ", ".join(f"{k}={v!r}" for k, v in similarity_fct.keywords.items())
        return f"{name}({keywords})" if keywords else name
    return getattr(similarity_fct, "__name__", type(similarity_fct).__name__)


def _gather_with_grad(t):
    """Every rank's rows of `t`, concatenated in rank order; gradients flow back to
    the rank that owns the rows. Without an initialized process group, `t` itself."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _mnr.gather_with_grad(t)
    return t


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _composed_mnr_loss(similarity_fct, queries, docs, scale, directions, partition_mode,
                       hardness_mode, hardness_strength, gather_across_devices):
    """The MNR loss with an arbitrary similarity function, computed whole as
    sentence-transformers does (full similarity matrices, torch.logsumexp): the
    fallback for a similarity the fused kernels do not compute. `docs` is the list
    of document columns (positives first), each with the rows of `queries`."""
    b = queries.shape[0]
    offset = 0
    if gather_across_devices:
        queries = _gather_with_grad(queries)
        docs = [_gather_with_grad(d) for d in docs]
        offset = _rank() * b
    r = queries.shape[0]
    candidates = torch.cat(docs, dim=0)
    device = queries.device
    g = torch.arange(offset, offset + b, device=device)
    j = torch.arange(candidates.shape[0], device=device)
    own = (j[None, :] % r) == g[:, None]  # the query's positive and its hard negatives
    local_queries, local_positives = queries[offset:offset + b], docs[0][offset:offset + b]

    sims = {"query_to_doc": similarity_fct(local_queries, candidates)}
    excluded = {}
    if "query_to_query" in directions:
        sims["query_to_query"] = similarity_fct(local_queries, queries)
        excluded["query_to_query"] = j[None, :r] == g[:, None]
    if "doc_to_query" in directions:
        sims["doc_to_query"] = similarity_fct(queries, local_positives).T
    if "doc_to_doc" in directions:
        sims["doc_to_doc"] = similarity_fct(candidates, local_positives).T
        excluded["doc_to_doc"] = own
    penalty = None
    if hardness_mode is not None and hardness_strength > 0.0:
        if hardness_mode == "in_batch_negatives":
            penalized = ~own
        elif hardness_mode == "hard_negatives":
            penalized = own & (j[None, :] >= r)
        else:  # all_negatives
            penalized = j[None, :] != g[:, None]
        penalty = (hardness_strength * sims["query_to_doc"].detach()) * penalized

    # Excluded pairs are masked after scaling: -inf * a tensor scale would give the
    # scale a NaN gradient.
    logits = {k: v * scale for k, v in sims.items()}
    for k, mask in excluded.items():
        logits[k] = logits[k].masked_fill(mask, float("-inf"))
    if penalty is not None:
        logits["query_to_doc"] = logits["query_to_doc"] + penalty
    positive = logits["query_to_doc"][torch.arange(b, device=device), g]
    if partition_mode == "joint":
        log_z = torch.logsumexp(torch.cat(list(logits.values()), dim=1), dim=1)
    else:
        log_z = sum(torch.logsumexp(v, dim=1) for v in logits.values()) / len(logits)
    return (log_z - positive).mean()


_EMBED_COLUMNS = []  # [sentence-transformers' embed_columns, or None], looked up once


def _embed_columns(model, sentence_features):
    """One sentence embedding per input column, as sentence-transformers' losses
    embed them (its embed_columns shares one forward pass among like columns, where
    that version has it; else one forward per column)."""
    if not _EMBED_COLUMNS:
        try:
            from sentence_transformers.base.losses.merged_forward import embed_columns
        except ImportError:
            embed_columns = None
        _EMBED_COLUMNS.append(embed_columns)
    if _EMBED_COLUMNS[0] is not None:
        return _EMBED_COLUMNS[0](model, sentence_features)
    return [model(features)["sentence_embedding"] for features in sentence_features]


_CITATION_CPC = """
@misc{oord2018cpc,
    title = {Representation Learning with Contrastive Predictive Coding},
    author = {Aaron van den Oord and Yazhe Li and Oriol Vinyals},
    year = {2018},
    eprint = {1807.03748},
    archivePrefix = {arXiv},
    url = {https://arxiv.org/abs/1807.03748},
}
"""
_CITATION_JINA2 = """
@misc{guenther2023jina2,
    title = {Jina Embeddings 2: 8192-Token General-Purpose Text Embeddings for Long Documents},
    author = {Michael G{\\"u}nther and Jackmin Ong and Isabelle Mohr and Alaeddine Abdessalem and
              Tanguy Abel and Mohammad Kalim Akram and Susana Guzman and Georgios Mastrapas and
              Saba Sturua and Bo Wang and Maximilian Werk and Nan Wang and Han Xiao},
    year = {2023},
    eprint = {2310.19923},
    archivePrefix = {arXiv},
    url = {https://arxiv.org/abs/2310.19923},
}
"""
_CITATION_GTE = """
@misc{li2023gte,
    title = {Towards General Text Embeddings with Multi-stage Contrastive Learning},
    author = {Zehan Li and Xin Zhang and Yanzhao Zhang and Dingkun Long and Pengjun Xie and
              Meishan Zhang},
    year = {2023},
    eprint = {2308.03281},
    archivePrefix = {arXiv},
    url = {https://arxiv.org/abs/2308.03281},
}
"""


class MultipleNegativesRankingLoss(torch.nn.Module):
    """Drop-in for sentence-transformers' ``MultipleNegativesRankingLoss`` (6.2):
    same constructor, checks, ``forward(sentence_features, labels)``,
    ``compute_loss_from_embeddings``, ``get_config_dict``, ``temperature`` and
    ``citation``, so it works with ``SentenceTransformerTrainer`` and
    ``SentenceTransformer.fit``; the loss is ``nanfree.ops.mnr_loss``: fused, no
    ``[B, B(1+k)]`` matrix stored, no NaN.

    The input columns are (anchor, positive, negative_1, ..., negative_k): the
    anchors are the queries, the positives the documents they are scored against
    with every other document of the batch, and the negatives extra documents
    (each query's own hard negatives, seen by every query).

    ``similarity_fct``: the fused loss scores cosine similarity, so it serves
    ``nanfree.ops.cos_sim`` (the default) and ``sentence_transformers.util.cos_sim``.
    Any other function (a dot product, say) is computed as sentence-transformers
    computes it, with whole similarity matrices, and a ``UserWarning`` says so once
    per loss instance. A ``hardness_mode`` with ``hardness_strength=0`` also gives a
    ``UserWarning`` (sentence-transformers logs it), at construction.
    ``scale`` may be a tensor (a learnable temperature); its gradient is computed.
    sentence-transformers itself is optional: it is imported only by ``forward``
    (for its column embedding), never by ``import nanfree.nn``.
    """

    def __init__(self, model, scale=20.0, similarity_fct=ops.cos_sim,
                 gather_across_devices=False, directions=("query_to_doc",),
                 partition_mode="joint", hardness_mode=None, hardness_strength=0.0):
        super().__init__()
        self.model = model
        self.directions = _check_mnr_config(type(self).__name__, scale, directions,
                                            partition_mode, hardness_mode, hardness_strength)
        self.scale = scale
        self.similarity_fct = similarity_fct
        self.gather_across_devices = gather_across_devices
        self.partition_mode = partition_mode
        self.hardness_mode = hardness_mode
        self.hardness_strength = hardness_strength
        self._warned_composed = False

    def forward(self, sentence_features, labels=None):
        embeddings = _embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, labels)

    def compute_loss_from_embeddings(self, embeddings, labels=None):
        """The loss of the column embeddings ``[anchors, positives, negatives...]``
        (each ``[B, d]``); ``labels`` is unused."""
        embeddings = list(embeddings)
        if len(embeddings) < 2:
            raise ValueError(f"nanfree.nn.{type(self).__name__}: the loss needs at least 2 "
                             f"embedding columns (anchors and "
                             f"positives), got {len(embeddings)}")
        if not _is_cosine(self.similarity_fct):
            if not self._warned_composed:
                self._warned_composed = True
                warnings.warn(f"nanfree MNR loss: similarity_fct "
                              f"{_similarity_name(self.similarity_fct)!r} is not cosine "
                              "similarity, so the loss is computed unfused, as "
                              "sentence-transformers computes it (whole similarity matrices)",
                              UserWarning, stacklevel=2)
            return _composed_mnr_loss(self.similarity_fct, embeddings[0], embeddings[1:],
                                      self.scale, self.directions, self.partition_mode,
                                      self.hardness_mode, self.hardness_strength,
                                      self.gather_across_devices)
        # The hard negative columns as they are: read in place, not stacked.
        negatives = list(embeddings[2:]) if len(embeddings) > 2 else None
        return ops.mnr_loss(embeddings[0], embeddings[1], negatives, scale=self.scale,
                            directions=_unique(self.directions),
                            partition_mode=self.partition_mode,
                            hardness_mode=self.hardness_mode,
                            hardness_strength=self.hardness_strength,
                            reduction="mean",
                            gather_across_devices=self.gather_across_devices)

    def get_config_dict(self):
        return {
            "scale": self.scale,
            "similarity_fct": _similarity_name(self.similarity_fct),
            "gather_across_devices": self.gather_across_devices,
            "directions": self.directions,
            "partition_mode": self.partition_mode,
            "hardness_mode": self.hardness_mode,
            "hardness_strength": self.hardness_strength,
        }

    @property
    def temperature(self):
        return 1.0 / self.scale

    @property
    def citation(self):
        directions, joint = set(self.directions), self.partition_mode == "joint"
        if directions == set(_DIRECTIONS) and joint:
            return _CITATION_GTE
        if directions == {"query_to_doc", "doc_to_query"} and not joint:
            return _CITATION_JINA2
        return _CITATION_CPC


class MultipleNegativesSymmetricRankingLoss(MultipleNegativesRankingLoss):
    """Drop-in for sentence-transformers' ``MultipleNegativesSymmetricRankingLoss``:
    :class:`MultipleNegativesRankingLoss` with
    ``directions=("query_to_doc", "doc_to_query")``, ``partition_mode="per_direction"``
    (the mean of the query-to-document and document-to-query losses)."""

    def __init__(self, model, scale=20.0, similarity_fct=ops.cos_sim,
                 gather_across_devices=False):
        super().__init__(model, scale=scale, similarity_fct=similarity_fct,
                         gather_across_devices=gather_across_devices,
                         directions=_mnr.SYMMETRIC[0], partition_mode=_mnr.SYMMETRIC[1])


class MNRLoss(torch.nn.Module):
    """The MNR (InfoNCE) loss of embeddings, without a model:
    ``forward(queries, positives, negatives=None)`` is ``nanfree.ops.mnr_loss`` with
    this module's settings (see it for the arguments).

    ``learnable_scale=True`` makes the scale a parameter, kept as its logarithm as
    CLIP keeps its logit scale (``log_scale``, initialized to ``log(scale)``; the
    scale used is ``log_scale.exp()``, always positive, unclamped). ``scale`` then
    reads the current value as a float."""

    def __init__(self, scale=20.0, *, symmetric=False, directions=("query_to_doc",),
                 partition_mode="joint", hardness_mode=None, hardness_strength=0.0,
                 reduction="mean", gather_across_devices=False, learnable_scale=False):
        super().__init__()
        if not isinstance(symmetric, bool):
            raise TypeError(f"nanfree.nn.{type(self).__name__}: `symmetric` must be a bool, got "
                            f"{symmetric!r}")
        if symmetric:
            directions, partition_mode = _mnr.SYMMETRIC
        name = type(self).__name__
        self.directions = _check_mnr_config(name, scale, directions, partition_mode,
                                            hardness_mode, hardness_strength)
        if not isinstance(reduction, str) or reduction not in ("mean", "sum", "none"):
            raise ValueError(f"nanfree.nn.{name}: `reduction` is 'mean', 'sum' or 'none', got "
                             f"{reduction!r}")
        if not isinstance(gather_across_devices, bool):
            raise TypeError(f"nanfree.nn.{name}: `gather_across_devices` must be a bool, got "
                            f"{gather_across_devices!r}")
        self.partition_mode = partition_mode
        self.hardness_mode = hardness_mode
        self.hardness_strength = hardness_strength
        self.reduction = reduction
        self.gather_across_devices = gather_across_devices
        if learnable_scale:
            if not math.isfinite(float(scale)):
                raise ValueError(f"nanfree.nn.{name}: `scale` must be finite, got {scale}")
            self.log_scale = torch.nn.Parameter(torch.tensor(math.log(float(scale))))
        else:
            self.log_scale = None
            self._scale = scale

    @property
    def scale(self):
        if self.log_scale is not None:
            return self.log_scale.detach().exp().item()
        return self._scale

    def forward(self, queries, positives, negatives=None):
        scale = self.log_scale.exp() if self.log_scale is not None else self._scale
        return ops.mnr_loss(queries, positives, negatives, scale=scale,
                            directions=_unique(self.directions),
                            partition_mode=self.partition_mode,
                            hardness_mode=self.hardness_mode,
                            hardness_strength=self.hardness_strength,
                            reduction=self.reduction,
                            gather_across_devices=self.gather_across_devices)

    def extra_repr(self):
        learnable = ", learnable_scale=True" if self.log_scale is not None else ""
        return (f"scale={self.scale:g}{learnable}, directions={self.directions}, "
                f"partition_mode={self.partition_mode!r}, hardness_mode={self.hardness_mode!r}, "
                f"hardness_strength={self.hardness_strength}, reduction={self.reduction!r}, "
                f"gather_across_devices={self.gather_across_devices}")


# --- the cached (GradCache) MNR losses: built on first access, from sentence-transformers ---

_CACHED = ("CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss")


def __getattr__(name):
    """The cached losses subclass sentence-transformers' own (its gradient cache,
    its mini-batching and random-state replay, unchanged): they are defined on
    first access, so ``import nanfree.nn`` never imports sentence-transformers."""
    if name not in _CACHED:
        raise AttributeError(f"module 'nanfree.nn' has no attribute {name!r}")
    try:
        from sentence_transformers.sentence_transformer.losses import \
            CachedMultipleNegativesRankingLoss as _Cached
    except ImportError as error:
        raise ImportError(f"nanfree.nn.{name} needs sentence-transformers (pip install "
                          "sentence-transformers): it is that library's gradient-cached loss with "
                          "nanfree's fused loss inside") from error
    classes = _cached_classes(_Cached)
    globals().update(classes)
    return classes[name]


def _cached_classes(base):
    class CachedMultipleNegativesRankingLoss(base):
        """Drop-in for sentence-transformers' ``CachedMultipleNegativesRankingLoss``
        (6.2, GradCache): the same constructor, ``forward``, ``get_config_dict``,
        ``temperature`` and ``citation``; the embeddings are computed in mini-batches
        of ``mini_batch_size`` without gradients, the loss and its gradients with
        respect to every embedding by ``nanfree.ops.mnr_loss`` (fused: no
        similarity matrix, no NaN, one pass over the batch instead of one per
        mini-batch), and the cached gradients pushed through each mini-batch again
        in the backward, by sentence-transformers' own machinery (this class
        subclasses its loss and replaces only ``calculate_loss``). The wrapped
        ``loss`` attribute is a :class:`nanfree.nn.MultipleNegativesRankingLoss`,
        which checks the hyperparameters. Needs sentence-transformers."""

        def __init__(self, model, scale=20.0, similarity_fct=ops.cos_sim, mini_batch_size=32,
                     mini_batch_num_tokens=None, gather_across_devices=False,
                     directions=("query_to_doc",), partition_mode="joint",
                     show_progress_bar=False, hardness_mode=None, hardness_strength=0.0):
            fused = MultipleNegativesRankingLoss(
                model, scale=scale, similarity_fct=similarity_fct,
                gather_across_devices=gather_across_devices, directions=directions,
                partition_mode=partition_mode, hardness_mode=hardness_mode,
                hardness_strength=hardness_strength)
            with warnings.catch_warnings():
                # the checks above already warned about a hardness mode without strength
                warnings.simplefilter("ignore")
                super().__init__(model, scale=scale, similarity_fct=similarity_fct,
                                 mini_batch_size=mini_batch_size,
                                 mini_batch_num_tokens=mini_batch_num_tokens,
                                 gather_across_devices=gather_across_devices,
                                 directions=directions, partition_mode=partition_mode,
                                 show_progress_bar=show_progress_bar,
                                 hardness_mode=hardness_mode,
                                 hardness_strength=hardness_strength)
            self.loss = fused

        def calculate_loss(self, reps, labels=None, *, with_backward=False):
            """The loss of the mini-batches' embeddings (``reps[column][mini_batch]``),
            in one fused call; with ``with_backward`` its gradients reach ``reps``
            and the detached loss is returned."""
            loss = self.loss.compute_loss_from_embeddings([torch.cat(c) for c in reps], labels)
            if with_backward:
                loss.backward()
                loss = loss.detach()
            return loss

    class CachedMultipleNegativesSymmetricRankingLoss(CachedMultipleNegativesRankingLoss):
        """Drop-in for sentence-transformers' ``CachedMultipleNegativesSymmetricRankingLoss``:
        :class:`CachedMultipleNegativesRankingLoss` with
        ``directions=("query_to_doc", "doc_to_query")`` and
        ``partition_mode="per_direction"``."""

        def __init__(self, model, scale=20.0, similarity_fct=ops.cos_sim, mini_batch_size=32,
                     mini_batch_num_tokens=None, gather_across_devices=False,
                     show_progress_bar=False):
            super().__init__(model, scale=scale, similarity_fct=similarity_fct,
                             mini_batch_size=mini_batch_size,
                             mini_batch_num_tokens=mini_batch_num_tokens,
                             gather_across_devices=gather_across_devices,
                             directions=_mnr.SYMMETRIC[0], partition_mode=_mnr.SYMMETRIC[1],
                             show_progress_bar=show_progress_bar)

    for cls in (CachedMultipleNegativesRankingLoss, CachedMultipleNegativesSymmetricRankingLoss):
        cls.__module__ = __name__
    return {cls.__name__: cls for cls in (CachedMultipleNegativesRankingLoss,
                                          CachedMultipleNegativesSymmetricRankingLoss)}


# --- losses (docs/losses.md) ------------------------------------------------------------
# Subclasses of torch's loss modules: the same constructor, buffers (weight,
# pos_weight) and state_dict keys, with nanfree's function in forward.


class BCEWithLogitsLoss(torch.nn.BCEWithLogitsLoss):
    def forward(self, input, target):
        return ops.binary_cross_entropy_with_logits(input, target, self.weight,
                                                    pos_weight=self.pos_weight,
                                                    reduction=self.reduction)


class BCELoss(torch.nn.BCELoss):
    def forward(self, input, target):
        return ops.binary_cross_entropy(input, target, weight=self.weight, reduction=self.reduction)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """torch.nn.CrossEntropyLoss; forward also takes the keyword-only `mask` of
    nanfree.ops.cross_entropy (nonzero = the class exists)."""

    def forward(self, input, target, *, mask=None):
        return ops.cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                                 reduction=self.reduction, label_smoothing=self.label_smoothing,
                                 mask=mask)


class KLDivLoss(torch.nn.KLDivLoss):
    def forward(self, input, target):
        return ops.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)


class SigmoidFocalLoss(torch.nn.Module):
    """torchvision.ops.sigmoid_focal_loss as a module (torchvision has none):
    alpha, gamma and reduction fixed at construction."""

    def __init__(self, alpha: float = 0.25, gamma: float = 2.0, reduction: str = "none") -> None:
        super().__init__()
        _check_positive("SigmoidFocalLoss", "gamma", gamma, allow_zero=True)
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(f"nanfree.nn.SigmoidFocalLoss: `reduction` must be 'none', 'mean' or "
                             f"'sum', got {reduction!r}")
        self.alpha = alpha
        self.gamma = gamma
        self.reduction = reduction

    def forward(self, inputs, targets):
        return ops.sigmoid_focal_loss(inputs, targets, self.alpha, self.gamma, self.reduction)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, gamma={self.gamma}, reduction={self.reduction!r}"
