"""Secrets recognised by their value, under any key at any depth: a database URL with a password, a
Sentry DSN, a W&B key nested under an innocent name and a Hugging Face token under another reach
neither a real Pushgateway's stored series nor the JSONL record nor the HTML report (4 of 4 masked)."""
from __future__ import annotations

import requests

from dualtrack.cli import main
from stack import processes
from tests.support.hook import run_id, wait_pushed
from trainer_hook import TrainingMonitor
from trainer_hook.contract import MASK, config_labels
from trainer_hook.masking import mask_text

DB_PASSWORD = "pg-Pa55word"
SENTRY_KEY = "0123456789abcdef0123456789abcdef"
WANDB_KEY = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"
HF_TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567"
CONFIG = {"data": {"url": f"postgresql://trainer:{DB_PASSWORD}@db.internal:5432/corpus?sslmode=require"},
          "sentry": f"https://{SENTRY_KEY}@o42.ingest.sentry.io/7",
          "wandb": {"api": WANDB_KEY, "project": "llm"},
          "hub": {"model": ["gpt2", {"revision": HF_TOKEN}]},
          "lr": 0.001, "tokenizer": "gpt2", "homepage": "https://huggingface.co/gpt2"}
SECRETS = (DB_PASSWORD, SENTRY_KEY, WANDB_KEY, HF_TOKEN)


def leaked(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


def test_secret_values_never_reach_the_pushgateway_the_record_or_the_report(tmp_path, start_service):
    pgw = start_service(processes.pushgateway(tmp_path))
    run, record = run_id("secrets"), tmp_path / "rec.jsonl"
    with TrainingMonitor(job="sec", run=run, pushgateway=pgw.url, record_path=record, config=CONFIG,
                         push_interval=60, delete_after=None) as monitor:
        monitor.log({"loss": 0.5}, step=1)
    wait_pushed(pgw.url, "training_loss", run, lambda v: v == 0.5)
    stored = requests.get(pgw.url + "/metrics", timeout=5).text
    assert "db.internal" in stored and leaked(stored) == []  # the host stays; the password goes
    assert leaked(record.read_text()) == []
    report = tmp_path / "report.html"
    assert main(["report", str(record), "--out", str(report)]) == 0
    assert "o42.ingest.sentry.io" in report.read_text() and leaked(report.read_text()) == []


def test_what_is_masked_and_what_is_kept():
    labels = config_labels(CONFIG)
    assert labels["data_url"] == f"postgresql://{MASK}@db.internal:5432/corpus?{MASK}"
    assert labels["sentry"] == f"https://{MASK}@o42.ingest.sentry.io/7"
    assert labels["wandb_api"] == MASK and labels["wandb_project"] == "llm"
    assert HF_TOKEN not in labels["hub_model"] and "gpt2" in labels["hub_model"]
    assert (labels["lr"], labels["tokenizer"], labels["homepage"]) == ("0.001", "gpt2", "https://huggingface.co/gpt2")
    for token in ("sk-proj-Ab1Cd2Ef3Gh4Ij5Kl6", "ghp_0123456789abcdefABCDEF", "xoxb-1234-5678-abcdef",
                  "AKIAIOSFODNN7EXAMPLE", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl"):
        assert mask_text(f"--key {token} --x") == f"--key {MASK} --x", token
    for plain in ("task-scheduler-with-long-name", "skip-connections", "AKIA", "eyJ", "cosine"):
        assert mask_text(plain) == plain
