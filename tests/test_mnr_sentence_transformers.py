"""nanfree.nn's MNR losses against sentence-transformers' own
MultipleNegativesRankingLoss: loss values and gradients (embeddings, tensor
scale) for every direction set, partition mode and hardness mode, with and
without hard negatives, in float32 and float64; the constructors' errors, the
config dicts, the citations; the non-cosine fallback; and short training runs
with SentenceTransformerTrainer and SentenceTransformer.fit on a tiny static
embedding model built here (no download)."""

import itertools
import warnings

import pytest
import torch
from conftest import INTERPRETED
from mnr_oracle import composed_mnr_loss

st = pytest.importorskip("sentence_transformers")

import nanfree.nn as nfnn  # noqa: E402
import nanfree.ops as nf  # noqa: E402
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402
from sentence_transformers.util import cos_sim as st_cos_sim  # noqa: E402

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
# Every direction set (query_to_doc is always in), joint; the two per_direction allows.
CONFIGS = [(("query_to_doc",) + extra, "joint")
           for n in range(4) for extra in itertools.combinations(ALL[1:], n)]
CONFIGS += [(("query_to_doc",), "per_direction"), (("query_to_doc", "doc_to_query"),
                                                   "per_direction")]
HARDNESS = [None, "in_batch_negatives", "hard_negatives", "all_negatives"]
# Under Triton's interpreter every launch runs in numpy: float64 only there.
DTYPES = [torch.float64] if INTERPRETED else [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: {}}


def _st_loss(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the symmetric class is deprecated in 6.2
        return (st_losses.MultipleNegativesSymmetricRankingLoss(None, **kwargs)
                if kwargs.pop("_symmetric", False)
                else st_losses.MultipleNegativesRankingLoss(None, **kwargs))


def _columns(k, dtype, b=6, d=12, seed=0):
    """anchors, positives and k negative columns [b, d], near each other row by
    row (the positives and negatives are noisy copies of their anchor) so the
    loss is neither saturated nor uniform; one leaf per column."""
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.randn(b, d, generator=gen, dtype=torch.float64)
    cols = [anchors] + [anchors + 0.8 * torch.randn(b, d, generator=gen, dtype=torch.float64)
                        for _ in range(1 + k)]
    return [c.to(dtype).requires_grad_(True) for c in cols]


def _loss_and_grads(loss_fn, columns, scale=None):
    columns = [c.detach().clone().requires_grad_(True) for c in columns]
    leaves = columns + ([scale] if scale is not None else [])
    value = loss_fn.compute_loss_from_embeddings(columns, None)
    return value.detach(), torch.autograd.grad(value, leaves)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("hardness_mode", HARDNESS)
@pytest.mark.parametrize("directions,partition_mode", CONFIGS,
                         ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_matches_sentence_transformers(directions, partition_mode, hardness_mode, k, dtype):
    kwargs = dict(scale=20.0, directions=directions, partition_mode=partition_mode,
                  hardness_mode=hardness_mode, hardness_strength=4.0 if hardness_mode else 0.0)
    columns = _columns(k, dtype)
    want, want_grads = _loss_and_grads(_st_loss(**kwargs), columns)
    got, got_grads = _loss_and_grads(nfnn.MultipleNegativesRankingLoss(None, **kwargs), columns)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("directions,partition_mode", [
    (("query_to_doc",), "joint"), (("query_to_doc", "doc_to_query"), "joint"),
    (("query_to_doc", "doc_to_query"), "per_direction")], ids=str)
@pytest.mark.parametrize("hardness_mode", [None, "all_negatives"])
def test_tensor_scale_gradient(directions, partition_mode, hardness_mode, dtype):
    """A learnable scale: sentence-transformers multiplies by it, so its gradient
    is defined (and finite there) for the directions that exclude no pair
    (query_to_query / doc_to_doc mask with -inf before scaling: NaN there)."""
    kwargs = dict(directions=directions, partition_mode=partition_mode,
                  hardness_mode=hardness_mode, hardness_strength=3.0 if hardness_mode else 0.0)
    columns = _columns(1, dtype)
    st_scale = torch.tensor(15.0, dtype=dtype, requires_grad=True)
    nf_scale = torch.tensor(15.0, dtype=dtype, requires_grad=True)
    want, want_grads = _loss_and_grads(_st_loss(scale=st_scale, **kwargs), columns, st_scale)
    got, got_grads = _loss_and_grads(nfnn.MultipleNegativesRankingLoss(None, scale=nf_scale,
                                                                       **kwargs),
                                     columns, nf_scale)
    torch.testing.assert_close(got, want, **TOL[dtype])
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **TOL[dtype])


def test_tensor_scale_with_excluded_pairs_is_finite():
    """Where sentence-transformers' scale gradient is NaN (query_to_query and
    doc_to_doc), nanfree's is finite and equals the float64 composed one with the
    excluded pairs masked after scaling."""
    q, p, n = _columns(1, torch.float64)
    scale = torch.tensor(15.0, dtype=torch.float64, requires_grad=True)
    loss = nfnn.MultipleNegativesRankingLoss(None, scale=scale, directions=ALL)
    got, got_grads = _loss_and_grads(loss, [q, p, n], scale)
    ref_scale = scale.detach().clone().requires_grad_(True)
    want = composed_mnr_loss(q, p, n[:, None], scale=ref_scale, directions=ALL)
    want_grads = torch.autograd.grad(want, [q, p, n, ref_scale])
    assert all(torch.isfinite(g).all() for g in got_grads)
    torch.testing.assert_close(got, want.detach())
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_symmetric_matches_sentence_transformers():
    columns = _columns(0, torch.float64)
    want, want_grads = _loss_and_grads(_st_loss(_symmetric=True, scale=10.0), columns)
    ours = nfnn.MultipleNegativesSymmetricRankingLoss(None, scale=10.0)
    got, got_grads = _loss_and_grads(ours, columns)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)
    assert ours.directions == ("query_to_doc", "doc_to_query")
    assert ours.partition_mode == "per_direction"


@pytest.mark.parametrize("similarity", ["st_cos_sim", "nf_cos_sim"])
def test_cosine_similarity_functions_are_fused(similarity):
    """sentence-transformers' cos_sim and nanfree's both take the fused path (no
    warning) and give sentence-transformers' loss."""
    fct = st_cos_sim if similarity == "st_cos_sim" else nf.cos_sim
    columns = _columns(1, torch.float64)
    want, _ = _loss_and_grads(_st_loss(similarity_fct=st_cos_sim), columns)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got, _ = _loss_and_grads(nfnn.MultipleNegativesRankingLoss(None, similarity_fct=fct),
                                 columns)
    torch.testing.assert_close(got, want)


def dot_score(a, b):
    return a @ b.T


@pytest.mark.backend_independent
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("directions,partition_mode", [
    (("query_to_doc",), "joint"), (ALL, "joint"),
    (("query_to_doc", "doc_to_query"), "per_direction")], ids=str)
def test_other_similarity_falls_back_to_composed(directions, partition_mode, k):
    """A dot product (not cosine) is computed as sentence-transformers computes it,
    with one UserWarning per loss instance."""
    kwargs = dict(scale=1.0, similarity_fct=dot_score, directions=directions,
                  partition_mode=partition_mode, hardness_mode="in_batch_negatives",
                  hardness_strength=0.5)
    columns = _columns(k, torch.float64)
    want, want_grads = _loss_and_grads(_st_loss(**kwargs), columns)
    ours = nfnn.MultipleNegativesRankingLoss(None, **kwargs)
    with pytest.warns(UserWarning, match="not cosine"):
        got, got_grads = _loss_and_grads(ours, columns)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # said once per instance
        _loss_and_grads(ours, columns)


# --- constructors, config, citation ---------------------------------------------------

BAD_CONFIGS = {
    "scale zero": dict(scale=0.0),
    "scale negative": dict(scale=-1.0),
    "scale nan": dict(scale=float("nan")),
    "no directions": dict(directions=()),
    "unknown direction": dict(directions=("query_to_doc", "doc_to_everything")),
    "without query_to_doc": dict(directions=("doc_to_query",)),
    "unknown partition": dict(partition_mode="softmax"),
    "per_direction query_to_query": dict(directions=("query_to_doc", "query_to_query"),
                                         partition_mode="per_direction"),
    "per_direction doc_to_doc": dict(directions=("query_to_doc", "doc_to_doc"),
                                     partition_mode="per_direction"),
    "unknown hardness": dict(hardness_mode="hardest"),
    "negative strength": dict(hardness_mode="all_negatives", hardness_strength=-1.0),
}


@pytest.mark.backend_independent
@pytest.mark.parametrize("kwargs", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_constructor_errors_as_sentence_transformers(kwargs):
    with pytest.raises(ValueError):
        _st_loss(**kwargs)
    with pytest.raises(ValueError):
        nfnn.MultipleNegativesRankingLoss(None, **kwargs)
    with pytest.raises(ValueError):
        nfnn.MNRLoss(**kwargs)


@pytest.mark.backend_independent
def test_hardness_without_strength_warns():
    with pytest.warns(UserWarning, match="hardness_strength"):
        nfnn.MultipleNegativesRankingLoss(None, hardness_mode="hard_negatives")
    with pytest.warns(UserWarning, match="hardness_strength"):
        nfnn.MNRLoss(hardness_mode="in_batch_negatives")


GOOD_CONFIGS = {
    "default": {},
    "symmetric": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
    "gte": dict(directions=ALL, scale=50.0),
    "hardness": dict(hardness_mode="hard_negatives", hardness_strength=5.0,
                     gather_across_devices=True),
    "dot": dict(similarity_fct=dot_score, scale=1.0),
}


@pytest.mark.backend_independent
@pytest.mark.parametrize("kwargs", GOOD_CONFIGS.values(), ids=GOOD_CONFIGS.keys())
def test_config_dict_temperature_citation(kwargs):
    theirs = _st_loss(**{"similarity_fct": st_cos_sim, **kwargs})
    ours = nfnn.MultipleNegativesRankingLoss(None, **kwargs)  # nanfree's cos_sim by default
    assert ours.get_config_dict() == theirs.get_config_dict()
    assert ours.temperature == theirs.temperature
    # The same work is cited (the entries are nanfree's own text).
    eprint = theirs.citation.split("eprint={")[1].split("}")[0]
    assert f"eprint = {{{eprint}}}" in ours.citation


@pytest.mark.backend_independent
def test_symmetric_config_dict():
    theirs = _st_loss(_symmetric=True, scale=7.0)
    ours = nfnn.MultipleNegativesSymmetricRankingLoss(None, scale=7.0)
    assert ours.get_config_dict() == theirs.get_config_dict()


@pytest.mark.backend_independent
def test_fewer_than_two_columns():
    with pytest.raises(ValueError, match="at least 2"):
        nfnn.MultipleNegativesRankingLoss(None).compute_loss_from_embeddings(
            [torch.randn(3, 4)], None)


# --- MNRLoss -------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mnr_module_is_the_op(reduction):
    q, p, n1, n2 = _columns(2, torch.float64)
    negatives = torch.stack([n1, n2], dim=1)
    module = nfnn.MNRLoss(12.0, directions=ALL, hardness_mode="all_negatives",
                          hardness_strength=2.0, reduction=reduction)
    want = nf.mnr_loss(q, p, negatives, scale=12.0, directions=ALL,
                       hardness_mode="all_negatives", hardness_strength=2.0, reduction=reduction)
    torch.testing.assert_close(module(q, p, negatives), want)


def test_mnr_module_learnable_scale():
    q, p = _columns(0, torch.float64)
    module = nfnn.MNRLoss(20.0, symmetric=True, learnable_scale=True)
    assert [name for name, _ in module.named_parameters()] == ["log_scale"]
    assert module.scale == pytest.approx(20.0)
    loss = module(q, p)
    loss.backward()
    grad = module.log_scale.grad
    assert grad is not None and torch.isfinite(grad)
    # d loss / d log_scale = scale * d loss / d scale.
    scale = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
    ref = nf.mnr_loss(q.detach(), p.detach(), scale=scale, symmetric=True)
    (ref_grad,) = torch.autograd.grad(ref, scale)
    torch.testing.assert_close(grad.double(), 20.0 * ref_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss.detach(), ref.detach())


@pytest.mark.backend_independent
def test_importing_nanfree_nn_does_not_import_sentence_transformers():
    import subprocess
    import sys

    code = ("import sys, nanfree.nn; "
            "sys.exit(any(m.split('.')[0] == 'sentence_transformers' for m in sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- training with sentence-transformers ---------------------------------------------

PAIRS = [("the cat sat on the mat", "a cat is resting on a rug"),
         ("the dog ran in the park", "a dog is running outside"),
         ("the sun is hot today", "it is a warm sunny day"),
         ("rain falls on the roof", "water drips from the sky"),
         ("the sky is blue", "a clear blue sky"),
         ("green grass grows fast", "the lawn needs mowing"),
         ("the train is late", "we will miss the connection"),
         ("coffee keeps me awake", "caffeine helps me stay up")]


def _tiny_model():
    """A SentenceTransformer of one StaticEmbedding (mean of 16-d token vectors)
    over a word-level tokenizer of the words in PAIRS: built here, trains in ms."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = dict.fromkeys(w for pair in PAIRS for text in pair for w in text.split())
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    return SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=16)],
                               device="cpu")


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _changed(before, model):
    return any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("hard_negatives", [False, True])
def test_sentence_transformer_trainer(tmp_path, hard_negatives):
    pytest.importorskip("datasets")
    pytest.importorskip("accelerate")
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)

    model = _tiny_model()
    columns = {"anchor": [a for a, _ in PAIRS], "positive": [p for _, p in PAIRS]}
    if hard_negatives:
        columns["negative"] = columns["positive"][1:] + columns["positive"][:1]
    loss = nfnn.MultipleNegativesRankingLoss(model, directions=ALL,
                                             hardness_mode="all_negatives", hardness_strength=2.0)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
        learning_rate=0.1, report_to="none", save_strategy="no", logging_steps=1,
        use_cpu=True, disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=args,
                                         train_dataset=Dataset.from_dict(columns), loss=loss)
    before = _snapshot(model)
    result = trainer.train()
    assert result.global_step == 2
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(logged)))
    assert _changed(before, model)
    # The model card names the loss and its config, and cites it.
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "nanfree.nn.MultipleNegativesRankingLoss" in card
    assert '"hardness_mode": "all_negatives"' in card
    assert "MultipleNegativesRankingLoss" in model.model_card_data.citations


@pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning")
def test_sentence_transformer_fit(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    pytest.importorskip("accelerate")
    from sentence_transformers import InputExample
    from torch.utils.data import DataLoader

    monkeypatch.chdir(tmp_path)  # fit keeps checkpoints/ in the working directory
    model = _tiny_model()
    examples = [InputExample(texts=list(pair)) for pair in PAIRS]
    loader = DataLoader(examples, batch_size=4, shuffle=False)
    loss = nfnn.MultipleNegativesSymmetricRankingLoss(model)
    losses = []
    forward = loss.forward

    def recording_forward(features, labels):
        value = forward(features, labels)
        losses.append(value.detach())
        return value

    loss.forward = recording_forward
    before = _snapshot(model)
    model.fit(train_objectives=[(loader, loss)], epochs=1, warmup_steps=0,
              optimizer_params={"lr": 0.1}, show_progress_bar=False)
    assert len(losses) == 2 and all(torch.isfinite(v) for v in losses)
    assert _changed(before, model)


# --- the cached (GradCache) losses ---------------------------------------------------

class _TinyEncoder(torch.nn.Module):
    """A sentence-transformers module: token ids -> mean of 16-d token vectors ->
    a linear layer, with dropout (so the cached losses must replay the random
    state). Not a StaticEmbedding, which the cached losses refuse."""

    def __init__(self):
        super().__init__()
        words = dict.fromkeys(w for pair in PAIRS for text in pair for w in text.split())
        self.vocab = {w: i + 1 for i, w in enumerate(words)}  # 0: padding and unknown
        self.embed = torch.nn.Embedding(len(self.vocab) + 1, 16, padding_idx=0)
        self.dropout = torch.nn.Dropout(0.1)
        self.linear = torch.nn.Linear(16, 16)

    def tokenize(self, texts, **kwargs):
        ids = [[self.vocab.get(w, 0) for w in text.split()] for text in texts]
        width = max(len(t) for t in ids)
        input_ids = torch.tensor([t + [0] * (width - len(t)) for t in ids])
        return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long()}

    def forward(self, features):
        mask = features["attention_mask"].unsqueeze(-1).float()
        tokens = self.dropout(self.embed(features["input_ids"]))
        mean = (tokens * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        features["sentence_embedding"] = self.linear(mean)
        return features

    def get_sentence_embedding_dimension(self):
        return 16


def _tiny_encoder_model():
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    return SentenceTransformer(modules=[_TinyEncoder()], device="cpu")


def _cached_loss_and_grads(loss_fn, model, columns, seed=3):
    features = [model.tokenize(texts) for texts in columns]
    model.zero_grad()
    torch.manual_seed(seed)
    value = loss_fn(features, None)
    value.backward()
    return value.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kwargs", [{}, dict(directions=ALL, hardness_mode="all_negatives",
                                             hardness_strength=2.0),
                                    dict(directions=("query_to_doc", "doc_to_query"),
                                         partition_mode="per_direction", scale=10.0)],
                         ids=["default", "every direction, hardness", "symmetric"])
@pytest.mark.parametrize("negatives", [False, True])
def test_cached_matches_sentence_transformers(kwargs, negatives):
    # The same model, batch and random state (dropout on): the loss and every
    # parameter's gradient as sentence-transformers' cached loss gives them,
    # with mini-batches of 3 rows of a batch of 8.
    columns = [[a for a, _ in PAIRS], [p for _, p in PAIRS]]
    if negatives:
        columns.append(columns[1][1:] + columns[1][:1])
    model = _tiny_encoder_model()
    ours = nfnn.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3, **kwargs)
    theirs = st_losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3, **kwargs)
    model.train()
    value, grads = _cached_loss_and_grads(ours, model, columns)
    ref_value, ref_grads = _cached_loss_and_grads(theirs, model, columns)
    torch.testing.assert_close(value, ref_value, rtol=2e-5, atol=2e-6)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=2e-4, atol=2e-6)
    assert isinstance(ours.loss, nfnn.MultipleNegativesRankingLoss)
    # Evaluation: no gradient cache, the loss alone.
    with torch.no_grad():
        features = [model.tokenize(texts) for texts in columns]
        model.eval()
        torch.testing.assert_close(ours(features, None), theirs(features, None),
                                   rtol=2e-5, atol=2e-6)


def test_cached_symmetric_config_citation():
    model = _tiny_encoder_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sentence-transformers' symmetric class is deprecated
        theirs = st_losses.CachedMultipleNegativesSymmetricRankingLoss(model, mini_batch_size=4)
    ours = nfnn.CachedMultipleNegativesSymmetricRankingLoss(model, mini_batch_size=4)
    assert ours.get_config_dict() == theirs.get_config_dict()
    assert ours.citation == theirs.citation and ours.temperature == theirs.temperature
    assert isinstance(ours, nfnn.CachedMultipleNegativesRankingLoss)
    assert type(ours).__module__ == "nanfree.nn"
    columns = [[a for a, _ in PAIRS], [p for _, p in PAIRS]]
    value, grads = _cached_loss_and_grads(ours, model, columns)
    ref_value, ref_grads = _cached_loss_and_grads(theirs, model, columns)
    torch.testing.assert_close(value, ref_value, rtol=2e-5, atol=2e-6)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=2e-4, atol=2e-6)


def test_cached_constructor_errors():
    model = _tiny_encoder_model()
    with pytest.raises(ValueError, match="scale"):
        nfnn.CachedMultipleNegativesRankingLoss(model, scale=float("nan"))
    with pytest.raises(ValueError):
        nfnn.CachedMultipleNegativesRankingLoss(model, partition_mode="neither")
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding  # noqa: F401
    with pytest.raises(ValueError, match="StaticEmbedding"):
        nfnn.CachedMultipleNegativesRankingLoss(_tiny_model())


def test_cached_loss_without_sentence_transformers_says_what_it_needs():
    import subprocess
    import sys

    code = ("import sys; sys.modules['sentence_transformers'] = None; import nanfree.nn as n\n"
            "try:\n    n.CachedMultipleNegativesRankingLoss\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert "needs sentence-transformers" in out.stdout
