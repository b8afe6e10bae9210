#!/usr/bin/env bash
# A tour of the payments example with curl: the same payment sent twice with one Idempotency-Key is one payment.
#
#   examples/walkthrough.sh [base-url]          (default http://localhost:8000)
#
# Start the API first: `docker compose up --build`, or
# `DATABASE_URL=postgresql://… uvicorn examples.payments.app:app --port 8000 --lifespan on` from the repository root,
# with IDEMPOTENCY_FINGERPRINT_KEYS set (docs/payments.md).
# Needs curl and python3 (to pick fields out of the JSON answers).
set -euo pipefail

base=${1:-http://localhost:8000}
account="sk_test_walkthrough_$(date +%s)"   # a fresh account, so its balance starts at zero

new_key() { python3 -c 'import uuid; print(uuid.uuid4())'; }
field() { python3 -c "import json, sys; print(json.load(sys.stdin)$1)"; }
post() { curl -sS -u "$account:" "$@"; }   # the secret key as Basic-auth user name, as with Stripe's curl examples
step() { printf '\n== %s\n' "$*"; }

step "create a customer"
customer=$(post -d email=jenny@example.com -d "metadata[crm_id]=42" "$base/v1/customers" | field '["id"]')
echo "customer: $customer"

step "pay 20.00 USD, with an Idempotency-Key"
pay_key=$(new_key)
pay() { post -H "Idempotency-Key: $pay_key" -d amount=2000 -d currency=usd -d confirm=true -d customer="$customer" \
             -d "metadata[order_id]=6735" "$@" "$base/v1/payment_intents"; }
first=$(pay)
intent=$(echo "$first" | field '["id"]')
echo "payment intent: $intent, status $(echo "$first" | field '["status"]')"

step "the response was lost, say: send the very same request again"
again=$(pay -i)
echo "$again" | grep -i '^idempotent-replayed' || { echo "expected a replay" >&2; exit 1; }
echo "same payment intent: $(echo "$again" | sed -n '/^{/,$p' | field '["id"]')"

step "reuse that key for a different request: 400 idempotency_error, as at Stripe"
post -H "Idempotency-Key: $pay_key" -d amount=9999 -d currency=usd "$base/v1/payment_intents"; echo

step "invalid parameters do not use up a key: fix the request and send it with the same key"
fix_key=$(new_key)
post -H "Idempotency-Key: $fix_key" -d amount=abc -d currency=usd "$base/v1/payment_intents"; echo
post -H "Idempotency-Key: $fix_key" -d amount=500 -d currency=usd -d confirm=true "$base/v1/payment_intents" \
    | field '["status"]'

step "refund 5.00, then the rest, then once too often"
post -H "Idempotency-Key: $(new_key)" -d payment_intent="$intent" -d amount=500 "$base/v1/refunds" | field '["amount"]'
post -H "Idempotency-Key: $(new_key)" -d payment_intent="$intent" "$base/v1/refunds" | field '["amount"]'
post -H "Idempotency-Key: $(new_key)" -d payment_intent="$intent" "$base/v1/refunds"; echo

step "the customer's payment intents, newest first, each with its customer expanded (a Stripe list)"
post -G -d customer="$customer" -d "expand%5B%5D=data.customer" "$base/v1/payment_intents" \
    | field '["data"][0]["customer"]["email"]'

step "a declined card: 402, recorded like any answer"
post -H "Idempotency-Key: $(new_key)" -d amount=700 -d currency=usd -d confirm=true \
     -d payment_method=pm_card_chargeDeclined "$base/v1/payment_intents" | field '["error"]["decline_code"]'

step "the balance: 5.00 (20.00 paid and refunded in full, 5.00 paid, 7.00 declined)"
post "$base/v1/balance" -G | field '["available"]'
