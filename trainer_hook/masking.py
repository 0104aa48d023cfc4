"""Secrets found by their value, whatever the key that holds them: URL credentials and token shapes.

contract.mask_secrets masks a value whose key names a secret; this module masks, inside any string,
what is a secret by its look:

- a URL's userinfo and query (`postgresql://app:pw@db/x?sslpassword=y` -> `postgresql://***@db/x?***`,
  a Sentry DSN `https://key@o1.ingest.sentry.io/2` -> `https://***@o1.ingest.sentry.io/2`);
- tokens of well-known shapes: Hugging Face `hf_`, OpenAI/Anthropic `sk-`, GitHub `ghp_`/`gho_`/`ghu_`/
  `ghs_`/`ghr_`/`github_pat_`, Slack `xox?-`, AWS access key ids `AKIA`/`ASIA`, JWTs `eyJ...`.

The rest of the string stays, so a masked value still says what it was (which database, which host).
"""
from __future__ import annotations

import re

MASK = "***"
_URL = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/?#]*@)?(?P<rest>[^\s?#]*)"
                  r"(?P<query>\?[^\s#]*)?")
_TOKEN = re.compile(r"(?<![A-Za-z0-9])(?:hf_[A-Za-z0-9]{16,}|sk-[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{16,}"
                    r"|github_pat_[A-Za-z0-9_]{16,}|xox[a-z]-[A-Za-z0-9-]{8,}|(?:AKIA|ASIA)[A-Z0-9]{16}"
                    r"|eyJ[A-Za-z0-9_-]{8,}(?:\.[A-Za-z0-9_-]*){0,2})")


def _url(match: re.Match[str]) -> str:
    userinfo = f"{MASK}@" if match["userinfo"] else ""
    query = f"?{MASK}" if match["query"] else ""
    return f"{match['scheme']}{userinfo}{match['rest']}{query}"


def mask_text(text: str) -> str:
    """`text` with URL userinfo and queries, and token-shaped words, replaced by MASK."""
    if "://" in text:
        text = _URL.sub(_url, text)
    return _TOKEN.sub(MASK, text)
