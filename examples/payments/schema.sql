-- The payments demo's tables, in their own schema. Applied by the app at startup, after the idempotency
-- migrations; every statement is safe to run again.
--
-- seq, on the objects the API lists, is their order of creation: lists are newest first, and their cursors
-- (starting_after, ending_before) compare seq, which created (whole seconds) could not order.
--
-- The ledger is the truth: an account's balance is the sum of its ledger entries, per currency. A captured
-- payment intent has exactly one 'charge' entry (+amount); every refund has exactly one 'refund' entry
-- (-amount). amount_received and amount_refunded on the payment intent are kept in step with the ledger in the
-- same transaction, and the CHECK constraints make an over-refund impossible whatever the application does.

CREATE SCHEMA IF NOT EXISTS payments;

CREATE TABLE IF NOT EXISTS payments.accounts (
    id         text PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS payments.customers (
    id          text PRIMARY KEY,
    account     text NOT NULL REFERENCES payments.accounts (id),
    email       text,
    name        text,
    description text,
    metadata    jsonb NOT NULL DEFAULT '{}',
    created     bigint NOT NULL,
    seq         bigint GENERATED ALWAYS AS IDENTITY,
    UNIQUE (account, id)
);

CREATE TABLE IF NOT EXISTS payments.payment_intents (
    id                 text PRIMARY KEY,
    account            text NOT NULL REFERENCES payments.accounts (id),
    customer           text,
    amount             bigint NOT NULL CHECK (amount > 0),
    currency           text NOT NULL,
    status             text NOT NULL
        CHECK (status IN ('requires_payment_method', 'requires_confirmation', 'succeeded')),
    payment_method     text,
    client_secret      text NOT NULL,
    amount_received    bigint NOT NULL DEFAULT 0,
    amount_refunded    bigint NOT NULL DEFAULT 0,
    last_payment_error jsonb,
    description        text,
    metadata           jsonb NOT NULL DEFAULT '{}',
    created            bigint NOT NULL,
    seq                bigint GENERATED ALWAYS AS IDENTITY,
    UNIQUE (account, id),
    -- a payment intent, and each of its refunds and ledger entries, belong to one account
    FOREIGN KEY (account, customer) REFERENCES payments.customers (account, id),
    CONSTRAINT captured_in_full CHECK (amount_received = CASE WHEN status = 'succeeded' THEN amount ELSE 0 END),
    CONSTRAINT refunds_within_captured CHECK (amount_refunded BETWEEN 0 AND amount_received)
);

CREATE TABLE IF NOT EXISTS payments.refunds (
    id             text PRIMARY KEY,
    account        text NOT NULL REFERENCES payments.accounts (id),
    payment_intent text NOT NULL,
    amount         bigint NOT NULL CHECK (amount > 0),
    currency       text NOT NULL,
    reason         text,
    metadata       jsonb NOT NULL DEFAULT '{}',
    created        bigint NOT NULL,
    seq            bigint GENERATED ALWAYS AS IDENTITY,
    FOREIGN KEY (account, payment_intent) REFERENCES payments.payment_intents (account, id)
);
CREATE INDEX IF NOT EXISTS refunds_payment_intent ON payments.refunds (payment_intent);

-- Databases created before lists existed get seq here (existing rows are numbered in no particular order).
DO $$
DECLARE
    listed text;
BEGIN
    FOREACH listed IN ARRAY ARRAY['customers', 'payment_intents', 'refunds'] LOOP
        IF NOT EXISTS (
            SELECT FROM pg_attribute
            WHERE attrelid = format('payments.%I', listed)::regclass AND attname = 'seq' AND NOT attisdropped
        ) THEN
            EXECUTE format('ALTER TABLE payments.%I ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY', listed);
        END IF;
    END LOOP;
END
$$;
CREATE INDEX IF NOT EXISTS customers_list ON payments.customers (account, seq);
CREATE INDEX IF NOT EXISTS payment_intents_list ON payments.payment_intents (account, seq);
CREATE INDEX IF NOT EXISTS refunds_list ON payments.refunds (account, seq);

CREATE TABLE IF NOT EXISTS payments.ledger (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account         text NOT NULL REFERENCES payments.accounts (id),
    currency        text NOT NULL,
    amount          bigint NOT NULL,
    kind            text NOT NULL,
    payment_intent  text NOT NULL,
    refund          text UNIQUE REFERENCES payments.refunds (id),
    -- The Idempotency-Key of the request that wrote the entry (NULL without one): the demo counts entries per
    -- key to prove that no retried request took effect twice.
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (account, payment_intent) REFERENCES payments.payment_intents (account, id),
    CONSTRAINT entry_shape CHECK (
        (kind = 'charge' AND amount > 0 AND refund IS NULL) OR (kind = 'refund' AND amount < 0 AND refund IS NOT NULL)
    )
);
CREATE UNIQUE INDEX IF NOT EXISTS ledger_one_charge_per_intent ON payments.ledger (payment_intent) WHERE kind = 'charge';
CREATE INDEX IF NOT EXISTS ledger_account_currency ON payments.ledger (account, currency);

-- Payouts (examples/payments/payouts.py): money sent to the account's bank through the payout provider, a process of
-- its own, in steps: the payout is created pending (a step of its own, committed), the provider makes its transfer,
-- and the transfer is recorded on the payout, which is then paid. Not part of the ledger: the demo keeps balances
-- to payments and refunds. One payout per logical operation, one transfer per payout (UNIQUE transfer).
CREATE TABLE IF NOT EXISTS payments.payouts (
    id              text PRIMARY KEY,
    account         text NOT NULL REFERENCES payments.accounts (id),
    amount          bigint NOT NULL CHECK (amount > 0),
    currency        text NOT NULL,
    status          text NOT NULL CHECK (status IN ('pending', 'paid')),
    transfer        text UNIQUE,
    metadata        jsonb NOT NULL DEFAULT '{}',
    idempotency_key text,
    created         bigint NOT NULL,
    CONSTRAINT paid_by_a_transfer CHECK ((status = 'paid') = (transfer IS NOT NULL))
);
CREATE INDEX IF NOT EXISTS payouts_account ON payments.payouts (account);
