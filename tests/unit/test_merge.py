"""Tests of core.merge: the pure merge of a rollout's calls into training sequences."""

from collections import Counter

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.merge import TooManyCalls, merge
from core.merge.prefixes import Packed, Prefixes, best_base, common_prefix_len
from core.merge.values import CAUSES, EXCLUSION_CAUSES, SIDE_CALLS, CallTokens, MergeOptions


def make_call(cid, seq, prompt, completion, status="ok", tools=True):
    completion = np.asarray(completion, dtype=np.int32)
    return CallTokens(
        id=cid,
        seq=seq,
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        completion_ids=completion,
        # Distinct per token and per call, so a logprob or version written at the wrong place
        # cannot pass for the right one.
        logprobs=-(completion % 97).astype(np.float32) / 10 - seq / 1000,
        versions=(seq // 3 + np.arange(completion.size) // 4).astype(np.int32),
        status=status,
        offered_tools=tools,
    )


def full(call):
    return np.concatenate([call.prompt_ids, call.completion_ids])


# ----------------------------------------------------------------------------------------------
# Checks that hold for any merge result


def check_faithful(result, calls):
    """Each sequence is its leaf's tokens; each path call's full sequence is a prefix of it (so a
    trained token is preceded by exactly its call's prompt and earlier sampled ids); the mask is 1
    on whole sampled spans only, with the call's own logprobs and versions there."""
    by_id = {c.id: c for c in calls}
    trained = Counter()
    for s in result.sequences:
        path = [by_id[i] for i in s.call_ids]
        assert np.array_equal(s.input_ids, full(path[-1]))
        assert len(s.loss_mask) == len(s.logprobs) == len(s.versions) == len(s.input_ids)
        expected_mask = np.zeros(len(s.input_ids), dtype=np.uint8)
        for up, call in zip([None, *path], path, strict=False):
            start, stop = call.prompt_ids.size, call.prompt_ids.size + call.completion_ids.size
            assert np.array_equal(s.input_ids[:stop], full(call))
            if up is not None:
                assert result.parents[call.id] == up.id
            span = s.loss_mask[start:stop]
            assert span.all() or not span.any(), "a call is trained in part"
            if call.completion_ids.size and span.all():
                trained[call.id] += 1
                expected_mask[start:stop] = 1
                assert np.array_equal(s.input_ids[start:stop], call.completion_ids)
                assert np.array_equal(s.logprobs[start:stop], call.logprobs)
                assert np.array_equal(s.versions[start:stop], call.versions)
        assert np.array_equal(s.loss_mask, expected_mask), "mask outside the path's sampled spans"
        assert not s.logprobs[expected_mask == 0].any()
        assert (s.versions[expected_mask == 0] == -1).all()
        if s.excluded:
            assert not s.loss_mask.any()
    assert max(trained.values(), default=1) == 1, "a call trained twice"
    assert result.stats.lost_tokens == 0
    assert result.stats.trained_tokens == sum(by_id[i].completion_ids.size for i in trained)
    # Every sampled token not trained is accounted for under exactly one cause.
    assert set(result.stats.excluded_by_cause) == set(EXCLUSION_CAUSES)
    assert sum(result.stats.excluded_by_cause.values()) == result.stats.excluded_tokens
    return set(trained)


def expected_training(calls, parents, abandoned, options):
    """From a known parent forest: per leaf (auxiliary, excluded), and the calls to train."""
    live = [c for c in calls if c.prompt_ids.size or c.completion_ids.size]
    by_id = {c.id: c for c in live}
    has_child = {p for p in (parents[c.id] for c in live) if p is not None}

    def blocked(c):
        return (c.id in abandoned and not options.train_abandoned) or (
            c.status != "ok" and not options.train_aborted
        )

    # Toolless paths are side calls beside agent work, or always when the rollout says so.
    side = options.side_calls == "toolless" or (
        options.side_calls == "auto" and any(c.offered_tools for c in live)
    )
    leaves, train = {}, set()
    for leaf in (c for c in live if c.id not in has_child):
        path = [leaf]
        while parents[path[-1].id] is not None:
            path.append(by_id[parents[path[-1].id]])
        auxiliary = side and not any(c.offered_tools for c in path)
        if auxiliary and not options.train_auxiliary:
            leaves[leaf.id] = (True, True)
            continue
        # A path that ends in an untrainable call still trains the calls before it; whether
        # the path itself is then marked excluded depends on whether another path trained
        # them first (None: either, checked against its mask by the caller).
        leaves[leaf.id] = (auxiliary, None if blocked(leaf) else False)
        train |= {c.id for c in path if not blocked(c) and c.completion_ids.size}
    return leaves, train


def check_flags(result, leaves):
    for s in result.sequences:
        auxiliary, excluded = leaves[s.call_ids[-1]]
        assert s.auxiliary == auxiliary
        if excluded is None:
            assert not s.excluded or not s.loss_mask.any()
        else:
            assert s.excluded == excluded


def canonical(result):
    return result.to_dict()


# ----------------------------------------------------------------------------------------------
# Rollouts built the way harnesses produce them, with fresh (unique) token ids so that every
# shared prefix is one the scenario made on purpose, and what the merge must find.


class Thread:
    def __init__(self, path, tokens):
        self.path, self.tokens, self.alive = path, tokens, True


class Rollout:
    def __init__(self, draw):
        self.draw = draw
        self.next_token = 1
        self.calls = []
        self.by_id = {}
        self.parents = {}
        self.causes = Counter()
        self.abandoned = set()
        self.fresh_context = {}  # call id -> positions of its own new context tokens
        self.system = self.fresh(draw(st.integers(0, 4)))
        self.threads = [self.new_thread(self.system, tools=True)]

    def fresh(self, n):
        tokens = np.arange(self.next_token, self.next_token + n, dtype=np.int32)
        self.next_token += n
        return tokens

    def number(self, low, high):
        return self.draw(st.integers(low, high))

    def add(self, prompt, parent, context_start, completion=None, status="ok", tools=True):
        if completion is None:
            completion = self.fresh(self.number(1, 6))
        call = make_call(f"c{len(self.calls) + 1}", len(self.calls) + 1, prompt, completion,
                         status, tools)
        self.calls.append(call)
        self.by_id[call.id] = call
        self.parents[call.id] = parent
        self.fresh_context[call.id] = (context_start, len(prompt))
        return call

    def new_thread(self, prefix, tools):
        prompt = np.concatenate([prefix, self.fresh(self.number(1, 6))])
        call = self.add(prompt, None, len(prefix), tools=tools)
        return Thread([call.id], full(call))

    def cut_parent(self, thread, position):
        """Index in the thread's path of the deepest call whose full sequence ends by `position`."""
        ends = [self.by_id[i].prompt_ids.size + self.by_id[i].completion_ids.size
                for i in thread.path]
        return sum(end <= position for end in ends) - 1

    # Events -------------------------------------------------------------------------------

    def turn(self, thread, status="ok", completion=None):
        prompt = np.concatenate([thread.tokens, self.fresh(self.number(1, 6))])
        call = self.add(prompt, thread.path[-1], thread.tokens.size, completion, status)
        thread.path.append(call.id)
        thread.tokens = full(call)
        return call

    def retry(self, thread, original, keep_retry):
        """The harness sends the same request again and continues from one of the answers."""
        again = self.add(original.prompt_ids, self.parents[original.id],
                         self.fresh_context[original.id][0])
        if original.completion_ids.size == 0:
            # Nothing was sampled: the original's full sequence is the retry's prompt, so the
            # retry continues it instead of being its sibling.
            self.parents[again.id] = original.id
            self.fresh_context[again.id] = (again.prompt_ids.size, again.prompt_ids.size)
            thread.path.append(again.id)
            thread.tokens = full(again)
            return
        self.causes["abandoned"] += 1
        if keep_retry:
            self.abandoned.add(original.id)
            thread.path[-1] = again.id
            thread.tokens = full(again)
        else:
            self.abandoned.add(again.id)
            self.turn(thread)

    def drift(self, thread):
        """The harness re-renders the conversation and one sampled token comes out different."""
        spans = [(c.prompt_ids.size, c.prompt_ids.size + c.completion_ids.size)
                 for c in (self.by_id[i] for i in thread.path) if c.completion_ids.size]
        start, stop = spans[self.number(0, len(spans) - 1)]
        position = self.number(start, stop - 1)
        rendered = thread.tokens.copy()
        rendered[position] = self.fresh(1)[0]
        k = self.cut_parent(thread, position)
        prompt = np.concatenate([rendered, self.fresh(self.number(1, 6))])
        call = self.add(prompt, thread.path[k] if k >= 0 else None, rendered.size)
        thread.path = thread.path[: k + 1] + [call.id]
        thread.tokens = full(call)
        self.causes["drift"] += 1

    def rewrite_places(self, thread):
        """(path index, cut) pairs strictly inside a call's own new context, after a sampled
        token: there the harness can edit the history without touching a sampled span."""
        places = []
        sampled = False
        for k, cid in enumerate(thread.path):
            start, stop = self.fresh_context[cid]
            if k and sampled:
                places += [(k, q) for q in range(start + 1, stop)]
            sampled |= self.by_id[cid].completion_ids.size > 0
        return places

    def rewrite(self, thread, places):
        k, cut = places[self.number(0, len(places) - 1)]
        prompt = np.concatenate([thread.tokens[:cut], self.fresh(self.number(1, 6))])
        call = self.add(prompt, thread.path[k - 1], cut)
        thread.path = thread.path[:k] + [call.id]
        thread.tokens = full(call)
        self.causes["rewrite"] += 1

    def compact(self, thread):
        """Compaction down to the system prompt: a new root of the same agent."""
        new = self.new_thread(self.system, tools=True)
        thread.path, thread.tokens = new.path, new.tokens
        self.causes["independent"] += 1

    def abort(self, thread):
        """A call ends early (client gone, engine error); the harness retries it or gives up."""
        status = self.draw(st.sampled_from(["aborted", "failed"]))
        call = self.turn(thread, status, self.fresh(self.number(0, 2)))
        if self.draw(st.booleans()):
            self.retry(thread, call, keep_retry=True)
        else:
            thread.alive = False

    def step(self, event):
        alive = [t for t in self.threads if t.alive]
        if event == "spawn" or not alive:
            self.threads.append(self.new_thread(self.system, tools=True))
            self.causes["independent"] += 1
            return
        if event == "aux":
            prefix = self.system if self.draw(st.booleans()) else self.system[:0]
            self.new_thread(prefix, tools=False)
            self.causes["independent"] += 1
            return
        if event == "empty":
            self.add(np.zeros(0, np.int32), None, 0, np.zeros(0, np.int32), "failed")
            return
        thread = alive[self.number(0, len(alive) - 1)]
        leaf = self.by_id[thread.path[-1]]
        if event == "retry" and leaf.status == "ok":
            self.retry(thread, leaf, self.draw(st.booleans()))
        elif event == "drift":
            self.drift(thread)
        elif event == "rewrite" and self.rewrite_places(thread):
            self.rewrite(thread, self.rewrite_places(thread))
        elif event == "compact":
            self.compact(thread)
        elif event == "abort":
            self.abort(thread)
        else:
            self.turn(thread)


EVENTS = ["turn", "turn", "turn", "retry", "drift", "rewrite", "compact", "spawn", "aux",
          "abort", "empty"]
OPTIONS = st.builds(MergeOptions, train_auxiliary=st.booleans(), train_abandoned=st.booleans(),
                    train_aborted=st.booleans(), side_calls=st.sampled_from(SIDE_CALLS))


@st.composite
def rollouts(draw):
    rollout = Rollout(draw)
    for event in draw(st.lists(st.sampled_from(EVENTS), max_size=24)):
        rollout.step(event)
    return rollout


@settings(max_examples=300, deadline=None)
@given(rollouts(), OPTIONS, st.randoms(use_true_random=False))
def test_merge_finds_the_structure_the_harness_made(rollout, options, rng):
    calls = list(rollout.calls)
    rng.shuffle(calls)
    result = merge(calls, options)

    assert result.parents == rollout.parents
    leaves, train = expected_training(rollout.calls, rollout.parents, rollout.abandoned, options)
    assert sorted(s.call_ids[-1] for s in result.sequences) == sorted(leaves)
    check_flags(result, leaves)
    causes = Counter(s.cause for s in result.sequences)
    assert causes.pop("start") == 1
    assert causes == rollout.causes
    assert result.stats.causes == {k: rollout.causes[k] for k in CAUSES}
    assert {s.call_ids[-1] for s in result.sequences if s.cause == "abandoned"} == (
        rollout.abandoned
    )

    assert check_faithful(result, rollout.calls) == train
    stats = result.stats
    assert stats.calls == len(rollout.calls)
    assert stats.sequences == len(leaves)
    assert stats.sampled_tokens == stats.trained_tokens
    assert stats.excluded_sequences == sum(s.excluded for s in result.sequences)
    assert stats.excluded_sequences >= sum(bool(excluded) for _, excluded in leaves.values())
    assert stats.auxiliary_sequences == sum(aux for aux, _ in leaves.values())
    assert stats.sampled_tokens + stats.excluded_tokens == sum(
        c.completion_ids.size for c in rollout.calls
    )

    rng.shuffle(calls)
    again = merge(calls, options)
    assert canonical(again) == canonical(result)
    assert canonical(merge(calls, options)) == canonical(again)


# ----------------------------------------------------------------------------------------------
# Arbitrary calls over a tiny vocabulary: accidental shared prefixes everywhere, equal-length and
# empty-completion corner cases. The structure is checked against a brute-force definition.


def brute_force_parents(calls):
    live = sorted((c for c in calls if c.prompt_ids.size or c.completion_ids.size),
                  key=lambda c: (c.seq, c.id))
    fulls = [full(c).tolist() for c in live]
    parents = {c.id: None for c in calls}
    for j, child in enumerate(live):
        prompt = child.prompt_ids.tolist()
        best = None
        for i, seq in enumerate(fulls):
            if i == j or len(seq) > len(prompt) or prompt[: len(seq)] != seq:
                continue
            if len(seq) == len(fulls[j]) and i > j:
                continue
            key = (len(seq), i < j, i)
            if best is None or key > best[0]:
                best = (key, i)
        if best is not None:
            parents[child.id] = live[best[1]].id
    return parents


def brute_force_abandoned(calls, parents):
    """Siblings (same parent, or both roots) with identical prompts are retries of one request;
    those with descendants are kept, else the latest; the others are abandoned."""
    live = sorted((c for c in calls if c.prompt_ids.size or c.completion_ids.size),
                  key=lambda c: (c.seq, c.id))
    with_children = {p for p in parents.values() if p is not None}
    groups = {}
    for c in live:
        groups.setdefault((parents[c.id], tuple(c.prompt_ids.tolist())), []).append(c.id)
    abandoned = set()
    for members in groups.values():
        kept = [m for m in members if m in with_children] or members[-1:]
        abandoned |= set(members) - set(kept)
    return abandoned


@st.composite
def tangles(draw):
    calls = []
    for n in range(draw(st.integers(1, 14))):
        base = []
        if calls and draw(st.booleans()):
            source = calls[draw(st.integers(0, len(calls) - 1))]
            source_full = full(source).tolist()
            base = source_full[: draw(st.integers(0, len(source_full)))]
        prompt = base + draw(st.lists(st.integers(1, 3), max_size=4))
        completion = draw(st.lists(st.integers(1, 3), max_size=3))
        calls.append(make_call(
            f"t{n}", draw(st.integers(1, 6)), prompt, completion,
            draw(st.sampled_from(["ok", "ok", "ok", "aborted", "failed"])), draw(st.booleans()),
        ))
    return calls


@settings(max_examples=400, deadline=None)
@given(tangles(), OPTIONS, st.randoms(use_true_random=False))
def test_merge_invariants_hold_for_any_calls(calls, options, rng):
    result = merge(calls, options)
    assert result.parents == brute_force_parents(calls)

    abandoned = brute_force_abandoned(calls, result.parents)
    assert {s.call_ids[-1] for s in result.sequences if s.cause == "abandoned"} == abandoned
    leaves, train = expected_training(calls, result.parents, abandoned, options)
    assert sorted(s.call_ids[-1] for s in result.sequences) == sorted(leaves)
    check_flags(result, leaves)
    for s in result.sequences:
        assert s.cause in {"start", *CAUSES}
    assert check_faithful(result, calls) == train
    assert sum(s.cause == "start" for s in result.sequences) <= 1

    shuffled = list(calls)
    rng.shuffle(shuffled)
    assert canonical(merge(shuffled, options)) == canonical(result)


def brute_force_lcp(x, y):
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def live_calls(calls):
    return sorted((c for c in calls if c.prompt_ids.size or c.completion_ids.size),
                  key=lambda c: (c.seq, c.id))


@settings(max_examples=300, deadline=None)
@given(tangles())
def test_common_prefixes_match_brute_force(calls):
    live = live_calls(calls)
    prefixes = Prefixes(Packed(live))
    for i, a in enumerate(live):
        assert prefixes.row(i).tolist() == [brute_force_lcp(full(a).tolist(), full(b).tolist())
                                            for b in live]


class MatrixPrefixes(Prefixes):
    """The merge's former common-prefix table: every pair's, an n x n matrix (parents are
    checked against brute force in test_merge_invariants_hold_for_any_calls)."""

    def __init__(self, packed):
        super().__init__(packed)
        fulls = [packed.full(i).tolist() for i in range(packed.F.size)]
        self.lcp = np.array([[brute_force_lcp(x, y) for y in fulls] for x in fulls],
                            dtype=np.int64).reshape(len(fulls), len(fulls))

    def row(self, i):
        return self.lcp[i]


@settings(max_examples=300, deadline=None)
@given(st.one_of(tangles(), rollouts().map(lambda r: r.calls)), OPTIONS)
def test_merge_equals_the_merge_over_the_whole_matrix(calls, options):
    result = merge(calls, options)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("core.merge.prefixes.Prefixes", MatrixPrefixes)
        reference = merge(calls, options)
    assert canonical(result) == canonical(reference)
    assert result.abandoned == reference.abandoned


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=600), st.lists(st.integers(0, 2), max_size=600))
def test_common_prefix_len_matches_brute_force(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_len(np.array(a, np.int32), np.array(b, np.int32)) == n
    assert common_prefix_len(a, a + b) == len(a)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=12),
       st.lists(st.lists(st.integers(0, 2), max_size=12), max_size=6))
def test_best_base_is_the_longest_common_prefix(prompt, candidates):
    named = [(f"k{i}", np.array(c, np.int32)) for i, c in enumerate(candidates)]
    base, shared = best_base(np.array(prompt, np.int32), named)
    lengths = [common_prefix_len(prompt, c) for c in candidates]
    assert shared == max(lengths, default=0)
    if shared == 0:
        assert base is None
    else:
        winner = max(range(len(candidates)),
                     key=lambda k: (lengths[k], len(candidates[k]), k))
        assert base == f"k{winner}"
    # Told which candidate opens the prompt, the answer is the same without comparing it.
    for k, c in enumerate(candidates):
        if c and prompt[: len(c)] == c:
            assert best_base(np.array(prompt, np.int32), named, opens=k) == (base, shared)


# ----------------------------------------------------------------------------------------------
# Examples


def chain():
    """System + user [1..4], three assistant turns with tool results in between."""
    a = make_call("a", 1, [1, 2, 3, 4], [10, 11])
    b = make_call("b", 2, [1, 2, 3, 4, 10, 11, 20, 21], [12, 13, 14])
    c = make_call("c", 3, [1, 2, 3, 4, 10, 11, 20, 21, 12, 13, 14, 22], [15])
    return [a, b, c]


def test_three_turn_chain_is_one_sequence():
    calls = chain()
    result = merge(calls[::-1])
    (s,) = result.sequences
    assert s.call_ids == ["a", "b", "c"] and s.cause == "start" and not s.excluded
    assert s.input_ids.tolist() == [1, 2, 3, 4, 10, 11, 20, 21, 12, 13, 14, 22, 15]
    assert s.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1]
    assert s.versions.tolist()[4:6] == calls[0].versions.tolist()
    assert s.versions.tolist()[:4] == [-1] * 4
    assert result.parents == {"a": None, "b": "a", "c": "b"}
    assert result.stats.trained_tokens == result.stats.sampled_tokens == 6


def test_drift_in_the_first_answer_starts_a_new_root():
    a, b, _ = chain()
    drifted = make_call("d", 3, [1, 2, 3, 4, 10, 99, 20, 21, 12, 13, 14, 22], [16])
    result = merge([a, b, drifted])
    assert [s.call_ids for s in result.sequences] == [["a", "b"], ["d"]]
    assert [s.cause for s in result.sequences] == ["start", "drift"]
    assert result.stats.causes == {"drift": 1, "rewrite": 0, "independent": 0, "abandoned": 0}
    assert result.stats.trained_tokens == 6 and result.stats.lost_tokens == 0


def test_drift_in_a_later_answer_forks_where_the_tokens_still_match():
    # The re-rendered second answer differs; the first still matches, so d continues a, next to
    # b. b is not a retry: its tokens were used (re-rendered), so it stays trained.
    a, b, _ = chain()
    drifted = make_call("d", 3, [1, 2, 3, 4, 10, 11, 20, 21, 12, 98, 14, 22], [16])
    result = merge([a, b, drifted])
    assert result.parents["d"] == "a"
    assert [(s.call_ids, s.cause) for s in result.sequences] == [
        (["a", "b"], "start"), (["a", "d"], "drift")]
    assert result.sequences[1].loss_mask.tolist()[4:6] == [0, 0]  # a trained once, in the first
    assert result.stats.trained_tokens == 6


def test_retry_leaves_an_abandoned_sibling():
    a, b, c = chain()
    retry = make_call("b2", 3, b.prompt_ids, [30, 31])
    c = make_call("c", 4, [1, 2, 3, 4, 10, 11, 20, 21, 30, 31, 22], [15])
    result = merge([a, b, retry, c])
    assert [(s.call_ids, s.cause, s.excluded) for s in result.sequences] == [
        (["a", "b"], "abandoned", True), (["a", "b2", "c"], "start", False)]
    assert result.stats.causes["abandoned"] == 1
    assert result.stats.excluded_tokens == 3 and result.stats.lost_tokens == 0
    trained = merge([a, b, retry, c], MergeOptions(train_abandoned=True))
    assert not trained.sequences[0].excluded
    assert trained.stats.trained_tokens == 8 and trained.stats.lost_tokens == 0


def test_retried_first_call_keeps_the_start():
    first = make_call("a", 1, [1, 2, 3], [7])
    again = make_call("a2", 2, [1, 2, 3], [8])
    follow = make_call("b", 3, [1, 2, 3, 8, 9], [10])
    result = merge([first, again, follow])
    assert [(s.call_ids, s.cause) for s in result.sequences] == [
        (["a"], "abandoned"), (["a2", "b"], "start")]


def test_compaction_after_the_first_turn_is_a_rewrite():
    a, b, c = chain()
    # The tool result [20, 21] is cut after its first token and a summary follows.
    compacted = make_call("k", 4, [1, 2, 3, 4, 10, 11, 20, 40, 41], [42])
    result = merge([a, b, c, compacted])
    assert result.parents["k"] == "a"
    assert [(s.call_ids, s.cause) for s in result.sequences] == [
        (["a", "b", "c"], "start"), (["a", "k"], "rewrite")]


def test_sub_agent_and_title_call_are_independent_and_the_title_is_auxiliary():
    a, b, c = chain()
    sub = make_call("s", 2, [1, 2, 50, 51], [52])  # shares only the system prompt [1, 2]
    title = make_call("t", 3, [60, 61], [62], tools=False)
    result = merge([a, sub, title, b, c])
    assert [(s.call_ids, s.cause, s.auxiliary, s.excluded) for s in result.sequences] == [
        (["a", "b", "c"], "start", False, False),
        (["s"], "independent", False, False),
        (["t"], "independent", True, True),
    ]
    assert result.stats.auxiliary_sequences == 1 and result.stats.excluded_tokens == 1
    kept = merge([a, sub, title, b, c], MergeOptions(train_auxiliary=True))
    assert kept.sequences[2].loss_mask.tolist() == [0, 0, 1]


def test_a_rollout_that_never_offered_tools_is_plain_chat_and_trains():
    qa = make_call("q", 1, [1, 2, 3], [4, 5, 6], tools=False)
    result = merge([qa])
    [seq] = result.sequences
    assert (seq.auxiliary, seq.excluded) == (False, False)
    assert seq.loss_mask.tolist() == [0, 0, 0, 1, 1, 1]
    assert result.stats.trained_tokens == 3 and result.stats.excluded_tokens == 0


def test_an_opencode_shaped_rollout_still_excludes_its_toolless_title_call():
    title = make_call("t", 1, [60, 61], [62, 63], tools=False)
    agent = make_call("a", 2, [1, 2, 3], [4, 5], tools=True)
    for side_calls in ("auto", "toolless"):
        result = merge([title, agent], MergeOptions(side_calls=side_calls))
        assert [(s.call_ids, s.auxiliary, s.excluded) for s in result.sequences] == [
            (["t"], True, True), (["a"], False, False)]
        assert result.stats.trained_tokens == 2
        assert result.stats.excluded_by_cause["auxiliary"] == 2
    every = merge([title, agent], MergeOptions(side_calls="none"))
    assert every.stats.trained_tokens == 4 and not any(s.auxiliary for s in every.sequences)


def test_a_rollout_of_only_side_calls_trains_nothing_when_its_creator_says_they_are():
    title = make_call("t", 1, [60, 61], [62, 63], tools=False)
    result = merge([title], MergeOptions(side_calls="toolless"))
    [seq] = result.sequences
    assert seq.auxiliary and seq.excluded and not seq.loss_mask.any()
    assert result.stats.trained_tokens == 0
    assert result.stats.excluded_by_cause == {**dict.fromkeys(EXCLUSION_CAUSES, 0), "auxiliary": 2}
    assert merge([title], MergeOptions(side_calls="toolless", train_auxiliary=True)).stats \
        .trained_tokens == 2


def test_side_calls_must_be_known():
    with pytest.raises(ValueError, match="side_calls"):
        MergeOptions(side_calls="sometimes")


def test_parallel_children_share_a_call_trained_once():
    a = make_call("a", 1, [1, 2], [3, 4])
    left = make_call("l", 2, [1, 2, 3, 4, 5], [6])
    right = make_call("r", 3, [1, 2, 3, 4, 7], [8])
    result = merge([right, left, a])
    first, second = result.sequences
    assert (first.call_ids, second.call_ids) == (["a", "l"], ["a", "r"])
    assert first.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert second.loss_mask.tolist() == [0, 0, 0, 0, 0, 1]
    assert second.cause == "rewrite"


def test_parent_may_arrive_after_its_child():
    # seq is arrival order at the gateway; a parent recorded late still is the parent.
    parent = make_call("p", 5, [1, 2], [3])
    child = make_call("c", 2, [1, 2, 3, 4], [5])
    result = merge([child, parent])
    assert result.parents == {"p": None, "c": "p"}
    assert [s.call_ids for s in result.sequences] == [["p", "c"]]


def test_aborted_last_call_is_context_and_the_calls_before_it_train():
    # An agent killed mid-stream (timeout) leaves an aborted last call: what it sampled before
    # is still good training data, conditioned exactly as before; only the cut call is not.
    a, b, _ = chain()
    cut = make_call("x", 3, [1, 2, 3, 4, 10, 11, 20, 21, 12, 13, 14, 22], [15], "aborted")
    result = merge([a, b, cut])
    (s,) = result.sequences
    assert not s.excluded and s.call_ids == ["a", "b", "x"]
    assert int(s.loss_mask.sum()) == result.stats.trained_tokens == (
        a.completion_ids.size + b.completion_ids.size)
    assert s.loss_mask[-1] == 0  # the aborted call's token
    assert result.stats.excluded_tokens == 1 and result.stats.lost_tokens == 0
    assert merge([a, b, cut], MergeOptions(train_aborted=True)).stats.trained_tokens == (
        a.completion_ids.size + b.completion_ids.size + 1)


def test_call_without_tokens_forms_no_sequence():
    a, b, c = chain()
    failed = make_call("f", 1, [], [], "failed")
    result = merge([failed, a, b, c])
    assert result.parents["f"] is None
    assert [s.call_ids for s in result.sequences] == [["a", "b", "c"]]
    assert result.sequences[0].cause == "start" and result.stats.calls == 4


def test_empty_completions_with_equal_prompts_do_not_cycle():
    x = make_call("x", 1, [1, 2], [])
    y = make_call("y", 2, [1, 2], [])
    result = merge([y, x], MergeOptions())
    assert result.parents == {"x": None, "y": "x"}


def test_result_serialises_to_json():
    import msgspec

    result = merge(chain())
    decoded = msgspec.json.decode(msgspec.json.encode(result.to_dict()))
    assert decoded["sequences"][0]["call_ids"] == ["a", "b", "c"]
    assert decoded["stats"]["lost_tokens"] == 0


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="logprobs"):
        CallTokens(id="a", seq=1, prompt_ids=[1], completion_ids=[2, 3], logprobs=[0.0],
                   versions=[0, 0], status="ok", offered_tools=True)
    with pytest.raises(ValueError, match="status"):
        make_call("a", 1, [1], [2], status="done")
    with pytest.raises(ValueError, match="duplicate"):
        merge([make_call("a", 1, [1], [2]), make_call("a", 2, [1, 2], [3])])


def test_best_base_examples():
    prompt = np.array([1, 2, 3, 4, 5, 6], np.int32)
    assert best_base(prompt, []) == (None, 0)
    assert best_base(prompt, [("x", np.array([9, 9]))]) == (None, 0)
    assert best_base(prompt, [("a", np.array([1, 2])), ("b", np.array([1, 2, 3, 9, 9, 9, 9])),
                              ("c", np.array([1, 2, 3, 4]))]) == ("c", 4)


# ----------------------------------------------------------------------------------------------
# Constrained, context-only and retried calls (issue 11)


@st.composite
def flagged(draw):
    """Tangles whose calls are randomly constrained, context-only or retries (by body digest or
    the SDK's retry header), with start times in any order."""
    calls = draw(tangles())
    return [
        msgspec.structs.replace(
            c,
            constrained=draw(st.booleans()),
            context_only=draw(st.booleans()),
            digest=draw(st.sampled_from([None, b"a", b"b"])),
            retry_count=draw(st.sampled_from([0, 0, 1])),
            started=draw(st.floats(0, 10)),
        )
        for c in calls
    ]


@settings(max_examples=300, deadline=None)
@given(flagged(), st.booleans())
def test_constrained_context_only_and_retried_calls_never_train(calls, train_constrained):
    options = MergeOptions(train_constrained=train_constrained)
    result = merge(calls, options)
    trained_ids = {cid for s in result.sequences for cid, span in _trained_spans(s, calls) if span}
    by_id = {c.id: c for c in calls}
    for cid in trained_ids:
        call = by_id[cid]
        assert not call.context_only
        assert train_constrained or not call.constrained
        assert cid not in result.abandoned
    live = [c for c in calls if c.prompt_ids.size or c.completion_ids.size]
    assert result.stats.constrained_calls == sum(c.constrained for c in live)
    assert result.stats.context_only_calls == sum(c.context_only for c in live)
    assert result.stats.retried_calls <= len(result.abandoned)


def _trained_spans(seq, calls):
    by_id = {c.id: c for c in calls}
    for cid in seq.call_ids:
        c = by_id[cid]
        span = seq.loss_mask[c.prompt_ids.size: c.prompt_ids.size + c.completion_ids.size]
        yield cid, bool(span.any())


def test_a_retry_header_abandons_the_latest_unused_attempt():
    first = make_call("first", 1, [1, 2], [3])
    retry = msgspec.structs.replace(make_call("retry", 2, [1, 2, 9], [4]), retry_count=1,
                                    started=1.0)
    result = merge([first, retry])
    assert result.abandoned == ["first"] and result.stats.retried_calls == 1
    # Continued calls are never a retry's earlier attempt.
    follow = make_call("follow", 2, [1, 2, 3, 5], [6])
    retry = msgspec.structs.replace(make_call("retry", 3, [7], [8]), retry_count=1, started=2.0)
    assert merge([first, follow, retry]).abandoned == ["follow"]


def test_the_same_body_again_abandons_the_first():
    a = msgspec.structs.replace(make_call("a", 1, [1, 2], [3]), digest=b"x", started=0.0)
    b = msgspec.structs.replace(make_call("b", 2, [1, 2], [4]), digest=b"x", started=1.0)
    result = merge([b, a])
    assert result.abandoned == ["a"] and result.stats.retried_calls == 1


def test_a_rollout_past_the_call_cap_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr("core.merge.MAX_CALLS", 2)
    calls = [make_call(f"c{i}", i, [1] * i, [2]) for i in range(1, 4)]
    assert merge(calls[:2]).stats.calls == 2
    with pytest.raises(TooManyCalls, match="3 calls, more than the 2"):
        merge(calls)
