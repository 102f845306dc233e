"""Embedded default checkpoints: a tiny Qwen2-architecture policy and GenRM, built offline (§8.1 setup).

Nothing is downloaded. A byte-level BPE tokenizer is trained locally with ``tokenizers`` on a
generated corpus (arithmetic problems in the DAPO prompt wording, answers, GenRM judgement text),
and two ``Qwen2ForCausalLM`` models are initialised at random with fixed seeds and saved with
``save_pretrained``.

Invariant: a cache folder ``tiny-<hash of the build spec>`` either does not exist or holds both
complete checkpoints; it is built in a temporary sibling folder and renamed into place, so two
processes building at once never see a half-written folder (the loser discards its copy).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\nRemember to put your answer on its own line after \"Answer:\"."
)
GENRM_TEXT = (
    "You are a careful grader. Read the question and the response, reason step by step about "
    "whether the response is correct, then give a final score.\n\nQuestion:\n{question}\n\n"
    "Response:\n{response}\n\nReasoning: {reasoning}\nScore: {score}/10\n\\boxed{{{score}}}"
)
_FORMAT_VERSION = 1
_COMPLETE_MARK = "tiny-spec.json"


@dataclass(kw_only=True, slots=True, frozen=True)
class TinyModelSpec:
    """Shape and seed of one random-init Qwen2 model."""

    seed: int  # torch seed for the random init
    hidden_size: int = 128  # head_dim = hidden_size / num_heads must be a size vLLM's CPU attention takes
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if self.max_position_embeddings < 2048:
            raise ValueError(f"max_position_embeddings must be >= 2048, got {self.max_position_embeddings}")


@dataclass(kw_only=True, slots=True, frozen=True)
class TinyBuildSpec:
    """Everything that determines the bytes of the embedded checkpoints (hashed into the folder name)."""

    vocab_size: int = 512  # BPE vocabulary incl. the 256 byte symbols and the special tokens
    corpus_seed: int = 0  # seed of the generated tokenizer-training corpus
    num_corpus_problems: int = 2000
    policy: TinyModelSpec = TinyModelSpec(seed=1234)
    genrm: TinyModelSpec = TinyModelSpec(seed=5678, num_layers=3, intermediate_size=384)

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {self.vocab_size}")

    def digest(self) -> str:
        blob = json.dumps({"format": _FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class TinyCheckpoints:
    """Folders that load with ``from_pretrained`` (model) and :func:`load_tokenizer` (tokenizer)."""

    policy_path: Path
    genrm_path: Path


def default_cache_root() -> Path:
    """``$PIVOTRL_CACHE`` if set, else ``~/.cache/pivotrl``."""
    env = os.environ.get("PIVOTRL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pivotrl"


def ensure_tiny_checkpoints(cache_dir: Path | None = None, spec: TinyBuildSpec | None = None) -> TinyCheckpoints:
    """Return the embedded policy and GenRM checkpoints, building them once under ``cache_dir``."""
    spec = spec or TinyBuildSpec()
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / f"tiny-{spec.digest()}"
    if not (final / _COMPLETE_MARK).exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            _build(tmp, spec)
            _publish(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return TinyCheckpoints(policy_path=final / "policy", genrm_path=final / "genrm")


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer as ``PreTrainedTokenizerFast`` (``AutoTokenizer`` would pick Qwen2's class)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; if another process published first, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / _COMPLETE_MARK).exists():
            raise


def _build(folder: Path, spec: TinyBuildSpec) -> None:
    tokenizer = _train_tokenizer(spec)
    for name, model_spec in (("policy", spec.policy), ("genrm", spec.genrm)):
        out = folder / name
        tokenizer.save_pretrained(str(out))
        _save_random_model(out, model_spec, tokenizer)
    (folder / _COMPLETE_MARK).write_text(json.dumps(dataclasses.asdict(spec), indent=1))


def corpus(seed: int, num_problems: int) -> list[str]:
    """Generated training text: DAPO-worded arithmetic prompts, worked answers, GenRM judgements."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_problems):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        problem = f"What is {a} {op} {b}?"
        response = f"We compute {a} {op} {b} = {value}.\nAnswer: {value}"
        score = rng.randint(0, 10)
        lines.append(DAPO_PROMPT.format(problem=problem))
        lines.append(response)
        lines.append(GENRM_TEXT.format(question=problem, response=response, reasoning="The steps check out.", score=score))
    return lines


def _train_tokenizer(spec: TinyBuildSpec) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(spec.corpus_seed, spec.num_corpus_problems), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE
    )


def _save_random_model(out: Path, spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)
    _init_weights(model, spec.seed, config.initializer_range)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)


def _init_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter from a private generator (thread-safe, independent of library init)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:  # weights and biases alike: nonzero biases exercise the converter
                param.normal_(0.0, std, generator=generator)
