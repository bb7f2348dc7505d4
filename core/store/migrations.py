"""Versioned schema migrations, applied at start-up under an advisory lock (idempotent, and safe
when several gateways start at once against one database)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.store.conn import Conn

# Append only: a released migration is never edited, a change is a new entry.
MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE rollouts (
            id            uuid PRIMARY KEY,
            key_hash      bytea NOT NULL UNIQUE,
            task_id       text,
            group_id      text,
            metadata      jsonb NOT NULL DEFAULT '{}',
            status        text NOT NULL DEFAULT 'running'
                          CHECK (status IN ('running', 'finished', 'failed', 'timeout')),
            reward        double precision,
            metrics       jsonb,
            call_count    integer NOT NULL DEFAULT 0,
            created_at    timestamptz NOT NULL DEFAULT now(),
            deadline      timestamptz,
            finished_at   timestamptz,
            -- merge: set when the rollout's calls have been merged into traces
            harness       text,
            merge_stats   jsonb,
            merge_options jsonb,
            merged_at     timestamptz,
            -- trainer bridge: a lease while a bridge turns the rollout into samples, and the
            -- moment its samples reached a trainer's queue
            lease_owner   text,
            lease_until   timestamptz,
            consumed_at   timestamptz
        );
        CREATE INDEX rollouts_group ON rollouts (group_id);
        CREATE INDEX rollouts_running_deadline ON rollouts (deadline) WHERE status = 'running';
        CREATE INDEX rollouts_unconsumed ON rollouts (finished_at)
            WHERE merged_at IS NOT NULL AND consumed_at IS NULL;

        -- Token arrays are little-endian int32 (ids, versions) and float32 (logprobs) bytes:
        -- 4 bytes a token, read back with numpy.frombuffer without parsing.
        -- A call stores only the prompt tokens past `prefix_len` tokens of its base call's
        -- prompt + completion (linear storage); `prompt_len` is the full length.
        CREATE TABLE calls (
            id             uuid PRIMARY KEY,
            rollout_id     uuid NOT NULL REFERENCES rollouts (id),
            seq            integer NOT NULL,
            protocol       text NOT NULL,
            status         text NOT NULL CHECK (status IN ('ok', 'aborted', 'failed')),
            base_id        uuid REFERENCES calls (id),
            prefix_len     integer NOT NULL DEFAULT 0,
            prompt_len     integer NOT NULL,
            prompt_delta   bytea NOT NULL,
            completion_ids bytea NOT NULL,
            logprobs       bytea NOT NULL,
            versions       bytea NOT NULL,
            finish_reason  text,
            offered_tools  boolean NOT NULL DEFAULT false,
            model          text,
            requested      jsonb NOT NULL DEFAULT '{}',
            applied        jsonb NOT NULL DEFAULT '{}',
            request_body   bytea,
            response_body  bytea,
            upstream       text,
            latency_ms     real,
            ttft_ms        real,
            error          text,
            user_agent     text,
            response_id    text,  -- the protocol's own id, for `previous_response_id` lookups
            -- exact continuation: how the prompt was made (path, reason, parent call), and the
            -- keys under which a later request of the rollout finds this call's reply
            continuation   jsonb,
            reply_keys     bytea[],
            created_at     timestamptz NOT NULL DEFAULT now(),
            UNIQUE (rollout_id, seq)
        );
        CREATE INDEX calls_response_id ON calls (response_id) WHERE response_id IS NOT NULL;

        -- One row per merged sequence (a root-to-leaf path of a rollout's call tree).
        CREATE TABLE traces (
            rollout_id  uuid NOT NULL REFERENCES rollouts (id),
            idx         integer NOT NULL,
            input_ids   bytea NOT NULL,
            loss_mask   bytea NOT NULL,  -- uint8
            logprobs    bytea NOT NULL,
            versions    bytea NOT NULL,
            call_ids    uuid[] NOT NULL,
            cause       text NOT NULL,
            auxiliary   boolean NOT NULL,
            excluded    boolean NOT NULL,
            PRIMARY KEY (rollout_id, idx)
        );

        CREATE TABLE policy (
            singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
            version    integer NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT now()
        );
        INSERT INTO policy (version) VALUES (0);
        """,
    ),
    (
        2,
        """
        -- Trainer bridge, exactly-once delivery to the optimizer (trainer_bridge/deliveries.py).
        -- A group is released once: its members' advantages are fixed then, so a redelivery
        -- after a crash trains the same numbers. `consumed_at` now means every trainable trace
        -- of the rollout is in `deliveries`. A group that failed too often is put aside.
        ALTER TABLE rollouts
            ADD COLUMN released_at       timestamptz,
            ADD COLUMN advantage         double precision,
            ADD COLUMN delivery_attempts integer NOT NULL DEFAULT 0,
            ADD COLUMN quarantined_at    timestamptz;
        UPDATE rollouts SET released_at = consumed_at WHERE consumed_at IS NOT NULL;

        -- The delivery log, append only: one row each time an optimizer step took a trace
        -- ('trained', with the step), or the bridge put it aside for good ('stale',
        -- 'too_long', 'untrained'). Not unique on purpose: were a trace ever trained twice,
        -- the log would show it.
        CREATE TABLE deliveries (
            id         bigserial PRIMARY KEY,
            rollout_id uuid NOT NULL REFERENCES rollouts (id),
            idx        integer NOT NULL,
            outcome    text NOT NULL
                       CHECK (outcome IN ('trained', 'stale', 'too_long', 'untrained')),
            owner      text NOT NULL,
            step       integer NOT NULL,
            leased     boolean NOT NULL,  -- the owner still held the rollout's lease
            at         timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX deliveries_trace ON deliveries (rollout_id, idx);
        """,
    ),
    (
        3,
        """
        -- Why a call went to another replica than its rollout's previous call (ejected,
        -- draining, removed, failed to connect); NULL when it stayed.
        ALTER TABLE calls ADD COLUMN rerouted text;
        """,
    ),
    (
        4,
        # Keyset pages of the trace viewer, `rolltap inspect` and `rolltap export`: newest
        # first, alone or under one equality filter, without a sort over 100k rollouts.
        """
        CREATE INDEX IF NOT EXISTS rollouts_recent ON rollouts (created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS rollouts_task_recent
            ON rollouts (task_id, created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS rollouts_group_recent
            ON rollouts (group_id, created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS rollouts_status_recent
            ON rollouts (status, created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS rollouts_harness_recent
            ON rollouts (harness, created_at DESC, id DESC);
        """,
    ),
    (
        5,
        """
        -- Recording integrity. `constrained`: the engine sampled under a grammar, banned or
        -- forced tokens, so its logprobs are not the free policy's. `body_digest` and
        -- `retry_count` (the SDK's retry header) let the merge mark an earlier attempt
        -- `abandoned`; `started_at` orders attempts (seq is commit order).
        ALTER TABLE calls
            ADD COLUMN constrained boolean NOT NULL DEFAULT false,
            ADD COLUMN body_digest bytea,
            ADD COLUMN retry_count integer NOT NULL DEFAULT 0,
            ADD COLUMN started_at  timestamptz,
            ADD COLUMN abandoned   boolean NOT NULL DEFAULT false;
        -- A merge that could not run: the rollout keeps its status and reward, the reason is
        -- shown by the admin API, and the sweeper does not retry it forever.
        ALTER TABLE rollouts ADD COLUMN merge_error text;

        -- A call of a rollout that has ended is refused, not silently kept out of its traces:
        -- finishing takes the rollout's row lock, the insert updates the same row first, so
        -- either the call commits before the finish (and is merged) or it is refused.
        CREATE FUNCTION rolltap_refuse_late_call() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NOT EXISTS (
                SELECT 1 FROM rollouts WHERE id = NEW.rollout_id AND status = 'running'
            ) THEN
                RAISE EXCEPTION 'rollout % has ended', NEW.rollout_id
                    USING ERRCODE = 'RT409';
            END IF;
            RETURN NEW;
        END
        $$;
        CREATE TRIGGER calls_rollout_running BEFORE INSERT ON calls
            FOR EACH ROW EXECUTE FUNCTION rolltap_refuse_late_call();
        """,
    ),
    (
        6,
        """
        -- Request bodies as deltas (core/store/bodies.py): `request_body` of a row with a
        -- `request_base` is a delta against that call's request body and response body (the
        -- reply the harness sends back); without one (every row written before this
        -- migration) it is the whole body, as before.
        ALTER TABLE calls ADD COLUMN request_base uuid REFERENCES calls (id);
        """,
    ),
    (
        7,
        # Postgres CPU per recorded call (issue #14). No table is rewritten: the storage
        # changes apply to values written from now on, values stored before read back as they
        # are.
        """
        -- A call of an ended rollout is refused by the insert itself (core/store/calls.py):
        -- its rollout row is locked and read there anyway, and a trigger re-read it per row.
        -- (A gateway older than this migration, still running next to a newer one, no longer
        -- refuses such calls: replace them together.)
        CREATE FUNCTION rolltap_refuse_call(rollout uuid) RETURNS integer LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'rollout % has ended', rollout USING ERRCODE = 'RT409';
        END
        $$;
        DROP TRIGGER calls_rollout_running ON calls;
        DROP FUNCTION rolltap_refuse_late_call();

        -- Every query by group serves from rollouts_group_recent (group_id first).
        DROP INDEX rollouts_group;

        -- Bodies are zstd frames already: a large row moves them out of line without first
        -- trying to compress them again.
        ALTER TABLE calls
            ALTER COLUMN request_body SET STORAGE EXTERNAL,
            ALTER COLUMN response_body SET STORAGE EXTERNAL;
        -- Token arrays large enough to be compressed (a rollout's first call, a fork: a
        -- long prompt delta) take lz4, 4-5x less CPU than pglz for 15-50% more bytes. A
        -- server built without lz4 keeps pglz.
        DO $$
        BEGIN
            ALTER TABLE calls
                ALTER COLUMN prompt_delta SET COMPRESSION lz4,
                ALTER COLUMN completion_ids SET COMPRESSION lz4,
                ALTER COLUMN logprobs SET COMPRESSION lz4,
                ALTER COLUMN versions SET COMPRESSION lz4;
        EXCEPTION WHEN feature_not_supported THEN
            NULL;
        END
        $$;
        """,
    ),
    (
        8,
        """
        -- Which toolless calls of a rollout are side calls (core/merge/): 'auto', 'toolless'
        -- or 'none', as its creator said on POST /admin/rollouts.
        ALTER TABLE rollouts ADD COLUMN side_calls text NOT NULL DEFAULT 'auto'
            CHECK (side_calls IN ('auto', 'toolless', 'none'));
        -- What the trainer bridge did with each consumed rollout (core/store/ledger.py):
        -- tokens trained and tokens excluded by cause, written when it is consumed.
        ALTER TABLE rollouts ADD COLUMN ledger jsonb;
        -- Per logged trace: the tokens the step trained, and those left out (masked stale, or
        -- the whole trace put aside as stale or too long).
        ALTER TABLE deliveries
            ADD COLUMN trained_tokens  integer,
            ADD COLUMN excluded_tokens integer;
        """,
    ),
    (
        9,
        """
        -- Each rollout's stored body bytes, bumped with its call count in the call's INSERT,
        -- which refuses a call past the rollout's limits (store/calls.py, SQLSTATE RT413).
        ALTER TABLE rollouts ADD COLUMN stored_bytes bigint NOT NULL DEFAULT 0;
        CREATE FUNCTION rolltap_refuse_over(rollout uuid, what text) RETURNS integer
        LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'rollout % is past its %', rollout, what USING ERRCODE = 'RT413';
        END
        $$;
        """,
    ),
]

_LOCK_ID = 0x726F6C6C746170  # "rolltap"


class SchemaTooNew(Exception):
    """The database was migrated by a newer rolltap."""


async def migrate(conn: Conn) -> int:
    """Bring the schema to the newest version; returns that version."""
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_ID)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        newest = MIGRATIONS[-1][0]
        if done and max(done) > newest:
            # A newer gateway moved rules into the schema's statements (migration 7: the
            # refusal of late calls); an older one would record without them.
            raise SchemaTooNew(
                f"the database's schema is version {max(done)}, newer than this rolltap knows "
                f"({newest}): upgrade rolltap on this machine to the version the other gateways "
                "run"
            )
        for version, sql in MIGRATIONS:
            if version in done:
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
        return newest
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_ID)
