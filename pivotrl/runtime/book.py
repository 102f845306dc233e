"""The rollout book: every sequence of a real run, from prompt to reward to training batch (§2.1, §8.1).

For step ``s`` the book draws ``prompts_per_step`` prompts, and for each ``group_size`` rollouts
(a GRPO group); ``seq_id = s · seqs_per_step + group · group_size + k`` (the control plane's ids).
A finished rollout gets a GenRM prompt (question + response, the judge's template, cut to fit the
GenRM's context); a finished judgement is scored (verifiable answer + parsed GenRM score, an
unparsed judgement counted and handled as ``RewardConfig.on_unparsed`` says, never scored silently).
A step's batch is split into whole GRPO groups per training device.

Invariant: each sequence gets exactly one response and one judgement (a second one raises).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pivotrl.roles.data import PromptDataset, PromptRecord, chat_token_ids
from pivotrl.roles.reward import (
    BUILT_IN_JUDGE,
    JudgeTemplate,
    Reward,
    RewardConfig,
    RewardFailure,
    RewardStats,
    ScoreFunction,
    genrm_messages,
    judge_token_ids,
    score_sequence,
)
from pivotrl.sim.workload import LengthDist

__all__ = ["SeqRecord", "RolloutBook", "SyntheticLengths", "fitting_prompts"]

TOO_LONG_FOR_POLICY = "prompt: too long for rollout.max_model_len - rollout.max_tokens"
TOO_LONG_FOR_GENRM = "question: too long for the GenRM prompt (genrm.max_model_len - genrm.max_tokens)"


def fitting_prompts(dataset: PromptDataset, tokenizer: Any, *, max_prompt_tokens: int, genrm_prompt_tokens: int,
                    score_scale: float, genrm_tokenizer: Any = None,
                    judge: JudgeTemplate = BUILT_IN_JUDGE) -> PromptDataset:
    """The prompts a run can use: the chat prompt leaves room for a whole response in the policy's context
    (``max_prompt_tokens``), and the GenRM prompt of the question with an empty response fits the GenRM's
    (``genrm_prompt_tokens``; a long response is cut to fit, the question and instructions never are).
    The others are skipped and counted in ``skipped`` (never cut, which would change the problem)."""
    dataset = dataset.select(lambda r: len(chat_token_ids(r.messages, tokenizer)) <= max_prompt_tokens,
                             TOO_LONG_FOR_POLICY)
    judge_tok = tokenizer if genrm_tokenizer is None else genrm_tokenizer
    fits = lambda r: len(judge_token_ids(genrm_messages(r.question, "", scale=score_scale, template=judge),  # noqa: E731
                                         judge_tok)) <= genrm_prompt_tokens
    return dataset.select(fits, TOO_LONG_FOR_GENRM)


@dataclass(slots=True)
class SeqRecord:
    seq_id: int
    step: int
    group_id: int  # the prompt's position in its step
    prompt: PromptRecord
    prompt_ids: list[int]
    response_ids: list[int] | None = None
    response_logprobs: list[float] | None = None  # behaviour log-prob of each response token
    response_version: int | None = None  # policy version of the replica that finished the response
    response_min_version: int | None = None  # oldest policy version that generated any of its tokens
    judge_prompt_ids: list[int] | None = None
    judgement_ids: list[int] | None = None
    reward: Reward | None = None


@dataclass(kw_only=True, slots=True)
class StepRewards:
    stats: RewardStats = field(default_factory=RewardStats)
    totals: list[float] = field(default_factory=list)


class SyntheticLengths:
    """The lengths of a synthetic-length workload: per step, a log-normal draw per sequence (the simulator's
    ``LengthDist``), seeded by (run seed, step, role) so a resumed run draws the same ones."""

    def __init__(self, *, response: LengthDist, judgement: LengthDist | None, seed: int, prompts_per_step: int,
                 group_size: int) -> None:
        self.dists = {"rollout": response, "reward": judgement}
        self.seed, self.prompts_per_step, self.group_size = seed, prompts_per_step, group_size
        self._drawn: dict[tuple[str, int], list[int]] = {}

    def tokens(self, role: str, seq_id: int) -> int | None:
        """The length ``seq_id`` must generate for ``role`` (None: where the engine stops)."""
        dist = self.dists[role]
        if dist is None:
            return None
        step, i = divmod(seq_id, self.prompts_per_step * self.group_size)
        key = (role, step)
        if key not in self._drawn:
            rng = np.random.default_rng([self.seed, 0x1E46, step, 0 if role == "rollout" else 1])
            self._drawn[key] = [int(n) for n in dist.sample(rng, self.prompts_per_step, self.group_size)]
        return self._drawn[key][i]

    def describe(self) -> dict[str, Any]:
        return {"lengths": "lognormal", **{role: None if d is None else {
            "median": d.median, "sigma": d.sigma, "max_tokens": d.max_tokens, "group_share": d.group_share}
            for role, d in self.dists.items()}}


class RolloutBook:
    """Prompts, responses, judgements and rewards of every step; see the module docstring."""

    def __init__(self, dataset: PromptDataset, tokenizer: Any, *, prompts_per_step: int, group_size: int, seed: int,
                 reward: RewardConfig, genrm_prompt_tokens: int, lengths: SyntheticLengths | None = None,
                 genrm_tokenizer: Any = None, judge: JudgeTemplate = BUILT_IN_JUDGE,
                 reward_function: ScoreFunction | None = None) -> None:
        self.lengths = lengths  # None: natural lengths
        self.dataset, self.tokenizer = dataset, tokenizer  # the policy's
        self.genrm_tokenizer = tokenizer if genrm_tokenizer is None else genrm_tokenizer
        self.judge = judge
        self.reward_function = reward_function  # None: the DAPO rule (RewardConfig.function)
        self.prompts_per_step, self.group_size, self.seed = prompts_per_step, group_size, seed
        self.reward_cfg = reward
        self.genrm_prompt_tokens = genrm_prompt_tokens  # longest GenRM prompt the GenRM engine can take
        self.records: dict[int, SeqRecord] = {}
        self.step_rewards: dict[int, StepRewards] = {}
        self.run_rewards = RewardStats()

    @property
    def seqs_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def rollouts(self, step: int) -> list[tuple[int, int]]:
        """Create the step's rollouts; returns ``(seq_id, prompt_tokens)`` for the scheduler."""
        out = []
        for g, prompt in enumerate(self.dataset.batch(step, self.prompts_per_step, seed=self.seed)):
            ids = chat_token_ids(prompt.messages, self.tokenizer)
            for k in range(self.group_size):
                seq_id = step * self.seqs_per_step + g * self.group_size + k
                self.records[seq_id] = SeqRecord(seq_id=seq_id, step=step, group_id=g, prompt=prompt,
                                                 prompt_ids=list(ids))
                out.append((seq_id, len(ids)))
        self.step_rewards[step] = StepRewards()
        return out

    def prompt_ids(self, role: str, seq_id: int) -> list[int]:
        rec = self.records[seq_id]
        if role == "rollout":
            return rec.prompt_ids
        assert rec.judge_prompt_ids is not None, f"seq {seq_id}: no GenRM prompt yet"
        return rec.judge_prompt_ids

    def response_done(self, seq_id: int, token_ids: list[int], version: int, *, logprobs: list[float] | None,
                      min_version: int | None = None) -> list[int]:
        """Record a finished rollout (its tokens' behaviour log-probs are required: the trainer's off-policy
        correction needs them); returns the GenRM prompt ids of its judgement."""
        rec = self.records[seq_id]
        if rec.response_ids is not None:
            raise RuntimeError(f"seq {seq_id}: a second response")
        if logprobs is None or len(logprobs) != len(token_ids):
            raise RuntimeError(f"seq {seq_id}: {len(token_ids)} response tokens but "
                               f"{'no' if logprobs is None else len(logprobs)} behaviour log-probs")
        rec.response_ids, rec.response_logprobs, rec.response_version = list(token_ids), list(logprobs), version
        rec.response_min_version = version if min_version is None else min_version
        rec.judge_prompt_ids = self._judge_prompt(rec)
        return rec.judge_prompt_ids

    def judgement_done(self, seq_id: int, token_ids: list[int]) -> Reward:
        rec = self.records[seq_id]
        if rec.judgement_ids is not None:
            raise RuntimeError(f"seq {seq_id}: a second judgement")
        rec.judgement_ids = list(token_ids)
        judgement = self.genrm_tokenizer.decode(token_ids, skip_special_tokens=True)
        rec.reward = score_sequence(self._response_text(rec), rec.prompt.ground_truth, judgement, self.reward_cfg,
                                    function=self.reward_function, data_source=rec.prompt.data_source,
                                    extra_info={"prompt_id": rec.prompt.prompt_id, "question": rec.prompt.question,
                                                "step": rec.step, "seq_id": rec.seq_id, "judgement": judgement})
        step = self.step_rewards[rec.step]
        step.stats.record(rec.reward)
        self.run_rewards.record(rec.reward)
        if rec.reward.total is not None:
            step.totals.append(rec.reward.total)
        return rec.reward

    def batch_shards(self, step: int, num_shards: int) -> list[dict[str, list[Any]]]:
        """The step's GRPO batch as ``num_shards`` equal shares of whole groups (one per training device)."""
        if self.prompts_per_step % num_shards:
            raise ValueError(f"prompts_per_step={self.prompts_per_step} does not split into {num_shards} "
                             "training devices")
        per = self.prompts_per_step // num_shards
        shards: list[dict[str, list[Any]]] = []
        base = step * self.seqs_per_step
        for i in range(num_shards):
            shard: dict[str, list[Any]] = {"prompt_ids": [], "response_ids": [], "group_ids": [], "rewards": [],
                                           "behaviour_logprobs": []}
            for seq_id in range(base + i * per * self.group_size, base + (i + 1) * per * self.group_size):
                rec = self.records[seq_id]
                assert rec.response_ids is not None and rec.reward is not None, f"seq {seq_id} is not rewarded"
                shard["prompt_ids"].append(rec.prompt_ids)
                shard["response_ids"].append(rec.response_ids)
                shard["group_ids"].append(rec.group_id)
                shard["rewards"].append(rec.reward.total)
                shard["behaviour_logprobs"].append(rec.response_logprobs)
            shards.append(shard)
        return shards

    def step_metrics(self, step: int) -> dict[str, Any]:
        """Reward and staleness figures of a step (for metrics.jsonl)."""
        rewards = self.step_rewards[step]
        recs = [self.records[s] for s in range(step * self.seqs_per_step, (step + 1) * self.seqs_per_step)]
        lags = [step - r.response_min_version for r in recs if r.response_min_version is not None]
        totals = rewards.totals
        mean = sum(totals) / len(totals) if totals else None
        std = math.sqrt(sum((t - mean) ** 2 for t in totals) / len(totals)) if totals and mean is not None else None
        verifiable = [r.reward.verifiable.score for r in recs
                      if r.reward is not None and not isinstance(r.reward.verifiable, RewardFailure)]
        return {"reward_mean": mean, "reward_std": std,
                "verifiable_mean": sum(verifiable) / len(verifiable) if verifiable else None,
                "accuracy": rewards.stats.num_correct / max(rewards.stats.num_judged, 1),
                "genrm_parsed": rewards.stats.num_parsed, "genrm_parse_failures": rewards.stats.num_unparsed,
                "num_dropped": rewards.stats.num_dropped, "reward_function_failures": rewards.stats.num_reward_failed,
                "reward_function_failure_examples": list(rewards.stats.reward_failures),
                "version_lag_max": max(lags) if lags else None,
                "version_lag_mean": sum(lags) / len(lags) if lags else None,
                "version_lag_counts": {str(lag): lags.count(lag) for lag in sorted(set(lags))},
                "response_tokens": sum(len(r.response_ids or ()) for r in recs),
                "judgement_tokens": sum(len(r.judgement_ids or ()) for r in recs)}

    def step_sequences(self, step: int) -> list[dict[str, Any]]:
        """The trace of a step: every sequence's tokens, behaviour log-probs, versions, judgement and reward."""
        out = []
        for seq_id in range(step * self.seqs_per_step, (step + 1) * self.seqs_per_step):
            rec = self.records[seq_id]
            reward = rec.reward
            failed = reward is not None and isinstance(reward.verifiable, RewardFailure)
            out.append({"step": step, "seq_id": seq_id, "group_id": rec.group_id, "prompt_id": rec.prompt.prompt_id,
                        "prompt_ids": rec.prompt_ids, "response_ids": rec.response_ids,
                        "behaviour_logprobs": rec.response_logprobs, "response_version": rec.response_version,
                        "response_min_version": rec.response_min_version, "judge_prompt_ids": rec.judge_prompt_ids,
                        "judgement_ids": rec.judgement_ids, "reward": None if reward is None else reward.total,
                        "verifiable": None if reward is None or failed else reward.verifiable.score,
                        "reward_failure": reward.verifiable.reason if failed else None,
                        "genrm": None if reward is None or reward.is_genrm_missing else reward.genrm.value})
        return out

    # ------------------------------------------------------------------ internals
    def _response_text(self, rec: SeqRecord) -> str:
        return self.tokenizer.decode(rec.response_ids or [], skip_special_tokens=True)

    def _judge_prompt(self, rec: SeqRecord) -> list[int]:
        """The GenRM prompt; a response too long for the GenRM's context keeps its end (where the answer is)."""
        text = self._response_text(rec)
        scale = self.reward_cfg.score_scale
        while True:
            ids = judge_token_ids(genrm_messages(rec.prompt.question, text, scale=scale, template=self.judge),
                                  self.genrm_tokenizer)
            if len(ids) <= self.genrm_prompt_tokens or not text:
                return ids[-self.genrm_prompt_tokens:] if len(ids) > self.genrm_prompt_tokens else ids
            text = text[max(1, len(text) // 4):]
