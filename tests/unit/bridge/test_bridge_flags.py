"""`rolltap bridge`'s flags as users see them, pinned: each one's default once parsed, whether it
is required, metavar, choices and help (with its `ROLLTAP_*` variable), so that generating them
from `BridgeConfig`'s fields (core/knobs.py) changes nothing."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from trainer_bridge.config import BridgeConfig

REQUIRED = ("model", "vllm", "gateway", "max_steps")

FLAGS = [
    ('--model', None, True, 'PATH', None,
     'model directory to train (the one vLLM serves) (env ROLLTAP_MODEL)'),
    ('--vllm', None, True, 'URL', None,
     'a vLLM replica to push weights to, e.g. http://127.0.0.1:8000; repeat for several '
     '(nccl: exactly one) (env ROLLTAP_VLLM)'),
    ('--gateway', None, True, 'URL', None,
     'a gateway to tell the new policy version; repeat for several (env ROLLTAP_GATEWAY)'),
    ('--admin-key', None, False, 'KEY', None,
     "the gateways' admin key (env ROLLTAP_ADMIN_KEY)"),
    ('--database-url', None, False, 'DSN', None,
     "the gateways' Postgres; without it, the embedded Postgres in --data-dir (env "
     'ROLLTAP_DATABASE_URL)'),
    ('--data-dir', None, False, 'DIR', None,
     "the gateway's data directory holding its embedded Postgres (default: the gateway's "
     'default) (env ROLLTAP_DATA_DIR)'),
    ('--output-dir', Path('runs/bridge'), False, 'DIR', None,
     'trainer output, progress.jsonl and summary.json (env ROLLTAP_OUTPUT_DIR; default '
     'runs/bridge)'),
    ('--metrics-port', None, False, 'PORT', None,
     "serve the trainer's Prometheus /metrics on 127.0.0.1:PORT (its idle fraction, steps, "
     "samples queued, taken and trained), e.g. for the viewer's run page (the gateway's "
     '--run-metrics) (env ROLLTAP_METRICS_PORT)'),
    ('--checkpoint-dir', None, False, 'DIR', None,
     'where checkpoints are written (disk sync: for the replicas to load, so the same path on '
     'their machines; nccl sync: to resume from) (default OUTPUT_DIR/weights) (env '
     'ROLLTAP_CHECKPOINT_DIR)'),
    ('--num-generations', 8, False, 'G', None,
     'rollouts per group (per task); a group is trained when G of them finished (env '
     'ROLLTAP_NUM_GENERATIONS; default 8)'),
    ('--max-steps', None, True, 'N', None,
     'optimizer steps to train; each is followed by a weight push (env ROLLTAP_MAX_STEPS)'),
    ('--learning-rate', 1e-06, False, 'LR', None,
     'AdamW learning rate, constant (env ROLLTAP_LEARNING_RATE; default 1e-06)'),
    ('--temperature', 1.0, False, 'T', None,
     "the policy's sampling temperature; must equal the gateway's --temperature (the bridge "
     'checks, and refuses to start otherwise) (env ROLLTAP_TEMPERATURE; default 1.0)'),
    ('--loss-normalization', 'token', False, None, ('token', 'rollout'),
     "token: TRL's loss, every trained token weighs the same; rollout: every rollout weighs "
     'the same whatever its length and sequence count (env ROLLTAP_LOSS_NORMALIZATION; '
     'default token)'),
    ('--importance-sampling', 'none', False, None, ('none', 'tis'),
     "none: TRL's clipped ratio against the recorded logprobs; tis: truncated importance "
     'sampling, each token weighted by min(C, exp(trainer logprob - recorded logprob)) (see '
     'README, training) (env ROLLTAP_IMPORTANCE_SAMPLING; default none)'),
    ('--tis-cap', 2.0, False, 'C', None,
     "C, the cap on a token's importance weight with --importance-sampling tis (env "
     'ROLLTAP_TIS_CAP; default 2.0)'),
    ('--std-scaling', True, False, None, None,
     "divide advantages by the group's reward std (--no-std-scaling: reward - group mean) "
     '(env ROLLTAP_STD_SCALING; default True)'),
    ('--shuffle-rewards', False, False, None, None,
     'a control run, not training: permute the rewards within each group before the '
     'advantages (a fixed permutation per group), so the policy gets a signal unrelated to '
     'what it did; a held-out change after such a run is what the loop does without one (env '
     'ROLLTAP_SHUFFLE_REWARDS; default False)'),
    ('--token-budget', 16384, False, 'N', None,
     'tokens per micro-batch row; longer sequences are skipped and logged, never truncated '
     '(env ROLLTAP_TOKEN_BUDGET; default 16384)'),
    ('--max-staleness', 4, False, 'N', None,
     'trained tokens more than N policy versions behind the trainer are masked out of the '
     'loss; the rest of their sequence trains (env ROLLTAP_MAX_STALENESS; default 4)'),
    ('--threads', None, False, 'N', None,
     "CPU threads for the trainer (default: torch's choice); on a CPU shared with vLLM, 1 "
     'keeps the two from stalling each other (env ROLLTAP_THREADS)'),
    ('--set', None, False, 'KEY=VALUE', None,
     'any other AsyncGRPOConfig field, VALUE as JSON or text, e.g. --set '
     'gradient_accumulation_steps=4 --set seed=1; repeatable (env ROLLTAP_OVERRIDES)'),
    ('--group-deadline', 600.0, False, 'S', None,
     "seconds after a group's first rollout finished until it is released incomplete (env "
     'ROLLTAP_GROUP_DEADLINE; default 600.0)'),
    ('--partial-groups', 'train', False, None, ('train', 'drop'),
     'what an incomplete group at its deadline becomes (env ROLLTAP_PARTIAL_GROUPS; default '
     'train)'),
    ('--match', None, False, 'KEY=VALUE', None,
     'only rollouts whose metadata has KEY=VALUE (VALUE as JSON or text: a text value that '
     'reads as JSON, like the id 64309107, goes in JSON quotes: run=\'"64309107"\'); '
     'repeatable (env ROLLTAP_MATCH)'),
    ('--queue-size', 64, False, 'N', None,
     'claim new groups only while fewer than N samples wait for the trainer (env '
     'ROLLTAP_QUEUE_SIZE; default 64)'),
    ('--lease-seconds', 60.0, False, 'S', None,
     "how long a claimed group stays this bridge's without a renewal; renewed until an "
     'optimizer step has taken its samples (env ROLLTAP_LEASE_SECONDS; default 60.0)'),
    ('--poll-interval', 2.0, False, 'S', None,
     'seconds between looks at the database when no notification arrives (env '
     'ROLLTAP_POLL_INTERVAL; default 2.0)'),
    ('--max-attempts', 5, False, 'N', None,
     'faults of a group (it could not be built into samples, or the trainer failed on them) '
     "before it is quarantined and reported; a bridge's crash does not count (env "
     'ROLLTAP_MAX_ATTEMPTS; default 5)'),
    ('--db-give-up', 600.0, False, 'S', None,
     'seconds of nothing but database errors before the bridge gives up (shorter outages are'
     ' retried with backoff) (env ROLLTAP_DB_GIVE_UP; default 600.0)'),
    ('--flush-after', 60.0, False, 'S', None,
     'seconds without a new sample after which the micro-batch the trainer holds is trained as'
     ' a step although it is not full (the last one of a finite run, or a quiet stretch) (env '
     'ROLLTAP_FLUSH_AFTER; default 60.0)'),
    ('--until-empty', False, False, None, None,
     'end the run once nothing is left to deliver (after training what the trainer holds), '
     'even before --max-steps (env ROLLTAP_UNTIL_EMPTY; default False)'),
    ('--report-every', 30.0, False, 'S', None,
     'seconds between lines saying what the bridge waits for when no step comes, and why the'
     ' groups it consumed trained nothing (env ROLLTAP_REPORT_EVERY; default 30.0)'),
    ('--weight-sync', 'disk', False, None, ('disk', 'nccl'),
     'how new weights reach vLLM (see above) (env ROLLTAP_WEIGHT_SYNC; default disk)'),
    ('--keep-checkpoints', 2, False, 'N', None,
     'disk sync: newest checkpoints kept; the last is the trained model (env '
     'ROLLTAP_KEEP_CHECKPOINTS; default 2)'),
    ('--resume', False, False, None, None,
     'start from the newest complete checkpoint in --checkpoint-dir (weights, optimizer, '
     'scheduler, step) and put back in the queue what later steps logged; without one, start '
     'from --model (env ROLLTAP_RESUME; default False)'),
    ('--state-every', 1, False, 'N', None,
     'save the optimizer and scheduler with every Nth checkpoint, which makes it one to resume'
     ' from (nccl sync: write a checkpoint every Nth push only); a crash re-trains at most N '
     'steps (raise it on GPUs, where the optimizer state is twice the model) (env '
     'ROLLTAP_STATE_EVERY; default 1)'),
    ('--pause-lease-seconds', 5.0, False, 'S', None,
     "a weight sync's pause is leased from the gateways for this long and renewed; a bridge "
     'that dies mid-push has its replicas resumed by the gateways once it runs out (env '
     'ROLLTAP_PAUSE_LEASE_SECONDS; default 5.0)'),
]


def test_flags_defaults_environment_names_and_help_are_todays(monkeypatch):
    for name in list(os.environ):
        if name.startswith("ROLLTAP_"):
            monkeypatch.delenv(name)
    parser = argparse.ArgumentParser()
    BridgeConfig.add_arguments(parser, required=REQUIRED)
    shown = [
        (action.option_strings[0], action.default, action.required, action.metavar,
         action.choices and tuple(action.choices), action.help % {"default": action.default})
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    ]
    assert shown == FLAGS
