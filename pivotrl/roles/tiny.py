"""Embedded default checkpoints: a tiny Qwen2-architecture policy and GenRM, built offline (§8.1 setup).

Nothing is downloaded. A byte-level BPE tokenizer is trained locally with ``tokenizers`` on a
generated corpus (the run's own texts: DAPO-worded arithmetic prompts, policy responses, GenRM
prompts and judgements). Two ``Qwen2ForCausalLM`` models are initialised at random with fixed
seeds, then warmed up by a short supervised run (``tiny_warmup.py``) so that RL on them can learn:
the policy answers some held-out arithmetic problems (``data.heldout_arithmetic``) right and many
wrong, and the GenRM scores correct responses higher than wrong ones. Both are saved with
``save_pretrained``. A build took 160 s on two cores here (75 s
for the policy's warm-up, 80 s for the GenRM's). The warm-up's floating point differs between
processors, so the default spec's build is shipped in the package (``shipped.py``) and is what
:func:`ensure_tiny_checkpoints` returns; other specs are built once per spec and machine.

Invariant: a cache folder ``tiny-<hash of the build spec>`` either does not exist or holds both
complete checkpoints; it is built in a temporary sibling folder and renamed into place, so two
processes building at once never see a half-written folder (the loser discards its copy). A build
is deterministic: the same spec gives byte-identical files on the same machine.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivotrl.roles.arithmetic import draw_split_problem
from pivotrl.roles.data import DAPO_PREFIX, DAPO_SUFFIX, wrap_dapo_problem
from pivotrl.roles.reward import genrm_messages
from pivotrl.roles.shipped import shipped_checkpoint
from pivotrl.roles.tiny_warmup import (
    GENRM_SCALE,
    WarmupSpec,
    claimed_answer,
    comparison_examples,
    genrm_examples,
    genrm_judgement,
    grow_into,
    policy_examples,
    policy_response,
    warm_up,
    wrong_response,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DAPO_PROMPT = DAPO_PREFIX + "{problem}" + DAPO_SUFFIX  # a user message of the arithmetic dataset
_FORMAT_VERSION = 2
_COMPLETE_MARK = "tiny-spec.json"
SHIPPED_NAME = "tiny"  # the shipped checkpoint's folder and manifest name


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
    # warm-up seeds: variant 2 of `benchmarks/tiny_warmup.py --spread 6` (seeds 1, 2, 3 moved by 1000 x variant),
    # the best balance of policy accuracy and GenRM gap of the six; it is the shipped build (docs/rl.md)
    policy_warmup: WarmupSpec = WarmupSpec(num_steps=600, seed=2001)  # supervised arithmetic answers
    genrm_warmup: WarmupSpec = WarmupSpec(num_steps=150, seed=2002, num_comparison_examples=128)  # judgements
    genrm_from_policy: bool = True  # the GenRM starts as the warmed-up policy grown to its shape (grow_into)

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {self.vocab_size}")
        p, g = self.policy, self.genrm
        if self.genrm_from_policy and not (
            (p.hidden_size, p.num_heads, p.num_kv_heads, p.tie_word_embeddings)
            == (g.hidden_size, g.num_heads, g.num_kv_heads, g.tie_word_embeddings)
            and g.intermediate_size >= p.intermediate_size and g.num_layers >= p.num_layers
        ):
            raise ValueError("genrm_from_policy: the genrm must have the policy's hidden_size, num_heads, num_kv_heads "
                             "and tie_word_embeddings, and at least its intermediate_size and num_layers")

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
    """The embedded policy and GenRM checkpoints: for the default spec and no ``cache_dir``, the ones shipped in
    the package (``shipped.py``; nothing is built); otherwise built once under ``cache_dir`` (default
    :func:`default_cache_root`)."""
    spec = spec or TinyBuildSpec()
    if cache_dir is None and spec == TinyBuildSpec():
        folder = shipped_checkpoint(SHIPPED_NAME, spec.digest())
        return TinyCheckpoints(policy_path=folder / "policy", genrm_path=folder / "genrm")
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = build_once(root / f"tiny-{spec.digest()}", lambda tmp: _build(tmp, spec), dataclasses.asdict(spec))
    return TinyCheckpoints(policy_path=final / "policy", genrm_path=final / "genrm")


def build_once(final: Path, build: Callable[[Path], None], spec: dict[str, Any]) -> Path:
    """``final``, built unless complete: ``build(tmp)`` fills a temporary sibling folder, ``spec`` is written
    as its completion mark, then it is renamed into place (module invariant)."""
    if not (final / _COMPLETE_MARK).exists():
        from pivotrl.console import say as _say

        def say(line: str) -> None:  # once per machine, not once per torchrun rank
            if os.environ.get("LOCAL_RANK", "0") == "0":
                _say(line)

        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        say(f"pivotrl: building {final.name} (first use; kept in {final.parent}) ...")
        t0 = time.perf_counter()
        try:
            build(tmp)
            (tmp / _COMPLETE_MARK).write_text(json.dumps(spec, indent=1))
            _publish(tmp, final)
            say(f"pivotrl: built {final.name} in {time.perf_counter() - t0:.0f} s")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


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
    policy = _warm_policy(spec, tokenizer)
    genrm = _warm_genrm(spec, tokenizer, policy)
    for name, model in (("policy", policy), ("genrm", genrm)):
        out = folder / name
        tokenizer.save_pretrained(str(out))
        model.save_pretrained(str(out), safe_serialization=True)


def _warm_policy(spec: TinyBuildSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    policy, warmup = _random_model(spec.policy, tokenizer), spec.policy_warmup
    warm_up(policy, [(policy_examples(tokenizer, warmup.seed), warmup.batch_size)], warmup,
            pad_id=tokenizer.pad_token_id)
    return policy


def _warm_genrm(spec: TinyBuildSpec, tokenizer: PreTrainedTokenizerFast, policy: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    genrm, warmup = _random_model(spec.genrm, tokenizer), spec.genrm_warmup
    if spec.genrm_from_policy:
        grow_into(policy, genrm)
    streams = [(genrm_examples(tokenizer, warmup.seed), warmup.batch_size),
               (comparison_examples(tokenizer, warmup.seed + 1), warmup.num_comparison_examples)]  # own stream
    warm_up(genrm, streams, warmup, pad_id=tokenizer.pad_token_id)
    return genrm


def corpus(seed: int, num_problems: int) -> list[str]:
    """Generated tokenizer-training text, in the run's own wording: per ``train`` problem its DAPO
    user message, the policy's response, and a GenRM prompt (right or wrong response) and judgement."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_problems):
        problem = draw_split_problem(rng, "train")
        response = policy_response(problem) if rng.random() < 0.5 else wrong_response(problem, rng)
        judge = genrm_messages(problem.question, response, scale=GENRM_SCALE)[-1]["content"]
        judgement = genrm_judgement(problem, claimed_answer(response))
        lines += [wrap_dapo_problem(problem.question), response, judge, judgement]
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


def _random_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
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
    return model


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
