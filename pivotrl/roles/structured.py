"""Constrained GenRM output (vLLM structured outputs) that survives a migration (§5.2, §6.2).

A GenRM engine may constrain every judgement it writes to a regular language: a choice among fixed
strings (the score grades ``Score: 0/10`` ... ``Score: 10/10``) or a user regex. The constraint is
compiled once into a DFA over characters (:class:`OutputDfa`). vLLM receives it as an EBNF grammar
whose start rule is a DFA state; it masks the logits to the tokens the grammar allows before the
sampler runs, so the migration-invariant Gumbel-max sampler (:mod:`pivotrl.roles.sampling`) samples
from the constrained distribution.

A sequence resumed on another replica arrives with its generated tokens folded into the prompt, which
vLLM's grammar does not read. Its grammar therefore starts in the state the DFA reaches on the text
generated so far (:meth:`OutputDfa.grammar_after`): from there the allowed continuations, hence the
token masks, are those of the uninterrupted run, and so are the tokens.

Regex dialect: Python's ``re`` syntax, read by ``interegular`` (which vLLM already depends on): ASCII
classes (``\\d``, ``\\w``, ``\\s`` as under ``re.ASCII``); the whole output must match (a full match), and
anchors, ``\\b``, look-arounds, back-references and conditional groups are refused.

Invariant: ``grammar_after(text)`` accepts exactly the strings ``s`` with ``text + s`` in the language.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["OutputDfa", "choice_dfa", "regex_dfa"]


@dataclass(frozen=True, slots=True)
class Edge:
    """A transition: on any char in ``chars``, or (``is_other``) on any char outside the DFA's alphabet."""

    chars: frozenset[str]
    is_other: bool
    target: int


@dataclass(frozen=True, slots=True)
class OutputDfa:
    """A DFA over characters whose states all reach a final state (dead states removed)."""

    initial: int
    finals: frozenset[int]
    edges: dict[int, tuple[Edge, ...]]  # state -> its transitions; every live state has an entry
    alphabet: frozenset[str]  # chars named explicitly; any other char is an "other" char

    def state_after(self, text: str) -> int | None:
        """The state reached on ``text`` from the initial state; None if no string of the language starts with it."""
        state = self.initial
        for char in text:
            is_other = char not in self.alphabet
            nxt = [e.target for e in self.edges[state] if (e.is_other if is_other else char in e.chars)]
            if not nxt:
                return None
            state = nxt[0]
        return state

    def accepts(self, text: str) -> bool:
        return self.state_after(text) in self.finals

    def grammar_after(self, text: str) -> str:
        """EBNF (xgrammar's dialect, which vLLM takes as ``StructuredOutputsParams(grammar=...)``) of the
        rest of an output that starts with ``text``; ``ValueError`` if no output of the language starts with it."""
        state = self.state_after(text)
        if state is None:
            raise ValueError(f"no output allowed by the constraint starts with {text[-80:]!r}")
        return self.grammar(state)

    def grammar(self, start: int) -> str:
        """EBNF of the strings the DFA accepts from state ``start``: one rule per reachable state."""
        lines, seen, todo = [f"root ::= s{start}"], {start}, [start]
        while todo:
            state = todo.pop()
            alternatives = []
            for edge in self.edges[state]:
                if edge.chars:
                    alternatives.append(f"[{_char_class(edge.chars)}] s{edge.target}")
                if edge.is_other:
                    other = f"^{_char_class(self.alphabet)}" if self.alphabet else "\\u0000-\\U0010FFFF"
                    alternatives.append(f"[{other}] s{edge.target}")
                if edge.target not in seen:
                    seen.add(edge.target)
                    todo.append(edge.target)
            if state in self.finals:
                alternatives.append('""')
            lines.append(f"s{state} ::= " + " | ".join(alternatives))
        return "\n".join(lines) + "\n"


def choice_dfa(choices: Sequence[str]) -> OutputDfa:
    """The DFA of exactly ``choices`` (a trie); ``ValueError`` if empty, with an empty string or a repeat."""
    if not choices:
        raise ValueError("must hold at least one string")
    if any(not isinstance(c, str) or not c for c in choices):
        raise ValueError(f"must be non-empty strings, got {list(choices)!r}")
    if len(set(choices)) != len(choices):
        raise ValueError(f"must be distinct, got {list(choices)!r}")
    state_of: dict[str, int] = {"": 0}
    targets: dict[int, dict[str, int]] = {0: {}}
    for choice in choices:
        for end in range(1, len(choice) + 1):
            prefix = choice[:end]
            if prefix not in state_of:
                state_of[prefix] = len(state_of)
                targets[state_of[prefix]] = {}
            targets[state_of[choice[:end - 1]]][choice[end - 1]] = state_of[prefix]
    edges = {s: tuple(Edge(frozenset(c), False, t) for c, t in out.items()) for s, out in targets.items()}
    return OutputDfa(initial=0, finals=frozenset(state_of[c] for c in choices), edges=edges,
                     alphabet=frozenset("".join(choices)))


def regex_dfa(pattern: str) -> OutputDfa:
    """The DFA of the strings that fully match ``pattern``; ``ValueError`` saying why if it cannot be used."""
    import interegular
    from interegular.fsm import anything_else

    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"must be a non-empty regular expression, got {pattern!r}")
    try:
        re.compile(pattern, re.ASCII)
    except re.error as err:
        raise ValueError(f"not a valid regular expression ({err}): {pattern!r}") from None
    reason = _unsupported(pattern)
    if reason is not None:
        raise ValueError(f"{reason}: {pattern!r}")
    try:
        fsm = interegular.parse_pattern(pattern).to_fsm()
    except Exception as err:  # noqa: BLE001 (interegular raises Unsupported, InvalidSyntax and bare Exception)
        raise ValueError(f"cannot be compiled into a DFA ({type(err).__name__}: {err}): {pattern!r}") from None
    chars_of: dict[int, set[str]] = {}
    for char, symbol in fsm.alphabet.items():
        chars_of.setdefault(symbol, set()).add(char)
    live = _live_states(fsm.map, fsm.finals)
    if fsm.initial not in live:
        raise ValueError(f"matches no string: {pattern!r}")
    edges = {}
    for state in live:
        by_target: dict[int, set[str]] = {}
        for symbol, target in fsm.map.get(state, {}).items():
            if target in live:
                by_target.setdefault(target, set()).update(chars_of.get(symbol, ()))
        edges[state] = tuple(Edge(frozenset(c for c in chars if c is not anything_else), anything_else in chars, t)
                             for t, chars in sorted(by_target.items()))
    alphabet = frozenset(c for c in fsm.alphabet.keys() if c is not anything_else)
    return OutputDfa(initial=fsm.initial, finals=frozenset(fsm.finals) & live, edges=edges, alphabet=alphabet)


_REFUSED = {"AT": "anchors and \\b", "ASSERT": "look-arounds", "ASSERT_NOT": "look-arounds",
            "GROUPREF": "back-references", "GROUPREF_EXISTS": "conditional groups"}
MAX_REPEAT_PRODUCT = 2000  # bounded repeats, nested counts multiplied: the DFA grows with it (2000: ~2 s to build)


def _unsupported(pattern: str) -> str | None:
    """Why ``pattern`` (parsed by ``re``) cannot be used, or None: a construct that a DFA of full matches does
    not express the way ``re`` does (interegular reads a trailing look-ahead as consumed text), or bounded
    repeats too large for a DFA."""
    from re import _constants, _parser  # the parser of re.compile (Python >= 3.11)

    todo: list[tuple[object, int]] = [(_parser.parse(pattern), 1)]
    while todo:
        item, repeats = todo.pop()
        if not isinstance(item, (_parser.SubPattern, list, tuple)):
            continue
        for part in item:
            if isinstance(part, tuple) and part and str(part[0]) in _REFUSED:
                return (f"{_REFUSED[str(part[0])]} are not supported (the output is matched in full; anchors, \\b, "
                        "look-arounds, back-references and conditional groups are refused)")
            if isinstance(part, tuple) and part and str(part[0]) in ("MAX_REPEAT", "MIN_REPEAT"):
                low, high, body = part[1]
                count = repeats * (max(low, 1) if high == _constants.MAXREPEAT else high)
                if count > MAX_REPEAT_PRODUCT:
                    return (f"bounded repeats allow {count} characters or groups, more than {MAX_REPEAT_PRODUCT} "
                            "(nested counts multiply); use * or + and let the token budget bound the output")
                todo.append((body, count))
            else:
                todo.append((part, repeats))
    return None


def _live_states(transitions: dict[int, dict[object, int]], finals: frozenset[int]) -> frozenset[int]:
    """States from which a final state is reachable."""
    incoming: dict[int, set[int]] = {}
    for state, out in transitions.items():
        for target in out.values():
            incoming.setdefault(target, set()).add(state)
    live, todo = set(finals), list(finals)
    while todo:
        for source in incoming.get(todo.pop(), ()):
            if source not in live:
                live.add(source)
                todo.append(source)
    return frozenset(live)


def _char_class(chars: frozenset[str]) -> str:
    """The inside of an EBNF character class holding ``chars``: ranges of consecutive code points."""
    points = sorted(ord(c) for c in chars)
    parts, start = [], 0
    for i in range(1, len(points) + 1):
        if i == len(points) or points[i] != points[i - 1] + 1:
            first, last = points[start], points[i - 1]
            parts.append(_char(first) if first == last else f"{_char(first)}-{_char(last)}")
            start = i
    return "".join(parts)


def _char(point: int) -> str:
    char = chr(point)
    if char.isascii() and char.isalnum():
        return char
    return f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}"
