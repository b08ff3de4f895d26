"""Overlay ddtree 0.3.0-rc.5's patch of SGLang's finish check (`Req.update_finish_state`).

A speculative round appends its whole accepted run to `output_ids`, then calls
`update_finish_state(run length)` once. SGLang 0.5.17 checks `max_new_tokens` first, so a run
that holds a stop inside the budget and crosses the cap finishes by length and returns the tokens
past the stop (run 17's stress request 33). The patched check must give every request what plain
decoding gives it: the same emitted tokens and the same finish reason.

`Req` itself cannot be imported here (schedule_batch.py pulls in SGLang's whole server stack), so
the test lifts the real methods out of the release file (pristine, and as rc.5 patches it) with
`ast` and binds them to a small class that holds only the fields they read; the tokenizer is a
one-character-per-token stand-in, enough for stop strings.
"""

from __future__ import annotations

import ast
import logging
import random
import re
import typing
from array import array
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

import pytest

from ddtree_deploy.catalog import load_overlay
from ddtree_deploy.patching import apply_patch
from ddtree_deploy.pristine import pristine_release
from tests.overlay.plan_digests import BASE, REPO

PATH = "sglang/srt/managers/schedule_batch.py"
RC5 = "ddtree@0.3.0-rc.5"
#: The Req methods the finish check runs, and the finish reasons it builds.
METHODS = {"finished", "update_finish_state", "_check_vocab_boundary_finish", "_check_str_based_finish",
           "_check_token_based_finish", "_locate_str_stop_finished_len", "_stop_match_tail_len", "tail_str",
           "output_ids_through_stop", "_check_stop_finish", "_check_stop_finish_token_by_token"}
REASONS = {"BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR", "FINISHED_MATCHED_REGEX",
           "FINISH_LENGTH", "FINISH_ABORT"}
EOS, STOP_TOKEN, VOCAB = 1, 2, 40
ALPHABET = "abcdefghijklmnopqrstuvwxyz ."


class CharTokenizer:
    """Token t >= 3 decodes to one character; the specials decode to nothing."""

    eos_token_id = EOS
    additional_stop_token_ids = None

    def decode(self, ids: Any) -> str:
        return "".join(ALPHABET[(t - 3) % len(ALPHABET)] for t in ids if t >= 3)


def encode(text: str) -> list[int]:
    return [ALPHABET.index(c) + 3 for c in text]


def lift(source: str) -> type:
    """A class carrying the real finish methods of `source`'s Req (and its finish reasons)."""
    tree = ast.parse(source)
    reasons = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in REASONS]
    req = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Req")
    methods = [node for node in req.body if isinstance(node, ast.FunctionDef) and node.name in METHODS]
    req.body, req.bases, req.decorator_list = methods, [], []
    namespace: dict[str, Any] = {"re": re, "logger": logging.getLogger("lifted"), "HTTPStatus": HTTPStatus,
                                 **{name: getattr(typing, name) for name in ("List", "Optional", "Union")}}
    exec(compile(ast.Module(body=[*reasons, req], type_ignores=[]), PATH, "exec"), namespace)
    return namespace["Req"]


@pytest.fixture(scope="module")
def pristine() -> type:
    return lift((pristine_release(BASE) / PATH).read_text())


@pytest.fixture(scope="module")
def patched() -> type:
    overlay = load_overlay(RC5, REPO / "overlays")
    release = (pristine_release(BASE) / PATH).read_bytes()
    landed, conflicts = apply_patch(overlay.patch_file(BASE, PATH), PATH, release)
    assert landed is not None, conflicts
    return lift(landed.decode())


def request(cls: type, cap: int, stop_strs: tuple[str, ...] = (), stop_token_ids: tuple[int, ...] = (), *,
            regexes: tuple[str, ...] = (), ignore_eos: bool = False, extra_stop_ids: tuple[int, ...] = ()) -> Any:
    req = cls()
    req.output_ids, req.finished_reason, req.finished_len, req.to_finish = array("q"), None, None, None
    req.grammar, req.tokenizer, req.vocab_size, req.decoded_text = None, CharTokenizer(), VOCAB, ""
    req.tokenizer.additional_stop_token_ids = set(extra_stop_ids) or None
    req.eos_token_ids, req.rid = {EOS}, "r"
    req.sampling_params = SimpleNamespace(
        max_new_tokens=cap, ignore_eos=ignore_eos, stop_strs=list(stop_strs), stop_regex_strs=list(regexes),
        stop_token_ids=set(stop_token_ids), stop_str_max_len=max((len(s) for s in stop_strs), default=0),
        stop_regex_max_len=8 if regexes else 0)
    return req


def outcome(req: Any, runs: list[list[int]]) -> tuple[dict[str, Any], Any, list[int]]:
    """Append each run and check the finish after it, as the scheduler does; (the finish reason's
    JSON, finished_len, emitted ids)."""
    for run in runs:
        if req.finished():
            break
        req.output_ids.extend(run)
        req.update_finish_state(len(run))
    assert req.finished(), "the cap always ends the request"
    return req.finished_reason.to_json(), req.finished_len, list(req.output_ids_through_stop)


def decode(req: Any, runs: list[list[int]]) -> tuple[str, list[int]]:
    """(reason type, emitted ids) of `outcome`."""
    reason, _, emitted = outcome(req, runs)
    return reason["type"], emitted


def test_an_early_stop_token_beats_a_later_stop_string_past_the_cap(pristine: type, patched: type) -> None:
    tokens = [5, EOS, *encode("zo bcdefgh")]
    plain = decode(request(pristine, 5, stop_strs=("zo ",)), [[t] for t in tokens])
    assert plain == ("stop", [5, EOS])
    assert decode(request(patched, 5, stop_strs=("zo ",)), [tokens]) == plain


def test_a_stop_token_inside_the_budget_beats_the_cap(pristine: type, patched: type) -> None:
    run = [[10, 11, STOP_TOKEN, 20, 21, 22]]
    assert decode(request(patched, 5, stop_token_ids=(STOP_TOKEN,)), run) == ("stop", [10, 11, STOP_TOKEN])
    # 0.5.17 returns two tokens past the stop and calls it a length finish
    assert decode(request(pristine, 5, stop_token_ids=(STOP_TOKEN,)), run) == ("length", [10, 11, STOP_TOKEN, 20, 21])


def test_a_stop_string_inside_the_budget_beats_the_cap(pristine: type, patched: type) -> None:
    # run 17's request 33: max_new_tokens 7, stop "zo ", the round accepted past both
    run = [encode("azo bcdefg")]
    assert decode(request(patched, 7, stop_strs=("zo ",)), run) == ("stop", encode("azo "))
    assert decode(request(pristine, 7, stop_strs=("zo ",)), run) == ("length", encode("azo bcd"))


@pytest.mark.parametrize(("text", "cap"), [("abczo de", 4), ("abczo de", 3), ("abcdefgzo ", 6)])
def test_a_stop_ending_at_or_past_the_cap_is_a_length_finish_at_the_cap(patched: type, text: str, cap: int) -> None:
    # "zo " ends at token 6 > 4 or 3; the EOS-free tail crosses the cap either way
    assert decode(request(patched, cap, stop_strs=("zo ",)), [encode(text)]) == ("length", encode(text)[:cap])


def test_an_eos_exactly_at_the_cap_finishes_by_length_as_plain_decoding_does(pristine: type, patched: type) -> None:
    one_by_one = [[t] for t in [5, 6, EOS]]
    assert decode(request(pristine, 3), one_by_one) == ("length", [5, 6, EOS])
    assert decode(request(patched, 3), [[5, 6, EOS, 7]]) == ("length", [5, 6, EOS])


def test_an_invalid_token_inside_the_budget_ends_the_request_at_it(patched: type) -> None:
    reason, emitted = decode(request(patched, 6), [[5, 6, VOCAB + 3, 7, 8, 9, 10]])
    assert (reason, emitted) == ("stop", [5, 6, EOS])  # sanitized to the EOS id, as 0.5.17 does


def test_an_early_eos_beats_a_later_invalid_token_in_the_same_run(pristine: type, patched: type) -> None:
    # 0.5.17 checks the whole run for invalid ids first, and would end at the later one
    tokens = [6, EOS, 7, VOCAB + 7, 8]
    plain = decode(request(pristine, 9), [[t] for t in tokens])
    assert plain == ("stop", [6, EOS])
    assert decode(request(patched, 9), [tokens]) == plain


def test_an_early_stop_token_beats_a_later_stop_string_in_the_same_run(pristine: type, patched: type) -> None:
    # 0.5.17 checks the whole run's text before its tokens, and would end at the later string
    tokens = [6, STOP_TOKEN, *encode("x.yz")]
    plain = decode(request(pristine, 9, ("x.",), (STOP_TOKEN,)), [[t] for t in tokens])
    assert plain == ("stop", [6, STOP_TOKEN])
    assert decode(request(patched, 9, ("x.",), (STOP_TOKEN,)), [tokens]) == plain


def random_case(rng: random.Random) -> tuple[list[int], dict[str, Any]]:
    # specials: EOS, the stop id, a special that is neither (0), ids outside the vocabulary
    specials = [EOS, STOP_TOKEN, 0, VOCAB, VOCAB + 7, -3]
    tokens = [rng.choice(specials) if rng.random() < 0.1
              else rng.randrange(3, 3 + len(ALPHABET)) for _ in range(rng.randrange(1, 30))]
    return tokens, {
        "cap": rng.randrange(0, 32),
        "stop_strs": tuple(rng.sample(["zo ", "ab", "q", "x.", "the"], rng.randrange(0, 3))),
        "stop_token_ids": (STOP_TOKEN,) if rng.random() < 0.5 else (),
        "regexes": tuple(rng.sample(["z+o", "a.c", "[xy]{2}"], rng.randrange(0, 2))),
        "ignore_eos": rng.random() < 0.2,
        "extra_stop_ids": (0,) if rng.random() < 0.2 else (),
    }


def split(tokens: list[int], rng: random.Random) -> list[list[int]]:
    runs, at = [], 0
    while at < len(tokens):
        size = rng.randrange(1, 17)
        runs.append(tokens[at:at + size])
        at += size
    return runs


def test_any_split_into_runs_finishes_as_plain_decoding_does(pristine: type, patched: type) -> None:
    """Random outputs, stops, caps and run lengths: the patched check on the runs, against
    0.5.17's on one token at a time (plain decoding, which the patch must leave as it is).
    Every output is padded past the cap so that the cap or a stop ends it. Cases draw caps from 0,
    stop strings, stop ids, regexes, ignore_eos and the tokenizer's extra stop ids. Equal means the
    same finish reason (type and what it matched), finished_len and emitted ids."""
    rng = random.Random(17)
    for _ in range(3000):
        tokens, case = random_case(rng)
        tokens += [rng.randrange(3, 3 + len(ALPHABET)) for _ in range(case["cap"] + 16)]
        plain = outcome(request(pristine, **case), [[t] for t in tokens])
        assert outcome(request(patched, **case), [[t] for t in tokens]) == plain
        assert outcome(request(patched, **case), split(tokens, rng)) == plain, (tokens, case)
