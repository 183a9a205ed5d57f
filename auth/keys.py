"""The API keys clients present to the router (Authorization: Bearer KEY).

Keys come from a YAML file (--api-keys-file; re-read when it changes), from
$TANDEM_API_KEY (one key, or several separated by commas) and from --api-key. Each
key from the file may carry:

- ``priority_ceiling``: the most important priority its requests may claim (lower
  value = more important); a request asking for more is refused (403);
- ``rate_limit_rps`` (and ``burst``): requests per second, a token bucket; beyond
  it, 429 with Retry-After;
- ``cache_group``: the prefix cache it shares. Each key's requests are cached apart
  from every other key's (router/cache_salt.py), keys of one name together (a rotated
  key keeps its cache); keys that name one cache_group share one cache, on purpose.

    keys:
      - key: sk-team-a-0123456789
        name: team-a
        priority_ceiling: 5
        rate_limit_rps: 10
        burst: 20
        cache_group: team-a-and-b
"""
from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

log = logging.getLogger(__name__)
ENV = "TANDEM_API_KEY"
RELOAD_CHECK_S = 1.0


class KeyFileError(ValueError):
    """An unusable key file or key (the message names the file, entry and field)."""


@dataclass
class ApiKey:
    key: bytes = field(repr=False)
    """The secret itself: never in a repr, so a logged key shows its name only."""
    name: str
    priority_ceiling: int | None = None
    rate_limit_rps: float | None = None
    burst: float = 1.0
    cache_group: str | None = None
    """Keys naming one group share one prefix cache; None: the key's own (by name)."""
    _tokens: float = field(default=0.0, repr=False)
    _at: float = field(default=0.0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._tokens = self.burst

    @property
    def cache_tenant(self) -> str:
        """Whose prefix cache this key's requests use. Tagged, so that a group and a key
        that share a name stay apart."""
        return f"group:{self.cache_group}" if self.cache_group is not None else f"key:{self.name}"

    def take(self, now: float | None = None) -> float:
        """Spend one request of the rate limit: 0.0 when allowed, else the seconds
        until one is."""
        if self.rate_limit_rps is None:
            return 0.0
        now = time.monotonic() if now is None else now
        with self._lock:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_limit_rps)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            return (1.0 - self._tokens) / self.rate_limit_rps


class KeyRing:
    def __init__(self, path: str | None = None, extra: tuple[str, ...] = ()) -> None:
        """path: the YAML key file; extra: plain keys (--api-key, $TANDEM_API_KEY)."""
        self.path = Path(path) if path else None
        self._plain = [ApiKey(k.encode(), f"key-{i}") for i, k in enumerate(extra) if k]
        self._from_file: list[ApiKey] = []
        self._mtime: float | None = None
        self._checked = 0.0
        if self.path is not None:
            self._from_file = parse_key_file(self.path)
            self._mtime = self.path.stat().st_mtime

    @classmethod
    def from_config(cls, path: str | None, api_key: str | None) -> KeyRing:
        env = os.environ.get(ENV, "")
        extra = tuple(k.strip() for k in env.split(",") if k.strip()) + ((api_key,) if api_key else ())
        return cls(path, extra)

    @property
    def enabled(self) -> bool:
        return bool(self._plain or self._from_file or self.path)

    def lookup(self, presented: bytes) -> ApiKey | None:
        """The key presented (Authorization header bytes, "Bearer " stripped), or None.
        Compares against every key in constant time."""
        self._maybe_reload()
        found = None
        for k in self._plain + self._from_file:
            if hmac.compare_digest(k.key, presented):
                found = k
        return found

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        try:
            mtime = self.path.stat().st_mtime
            if mtime != self._mtime:
                self._from_file, self._mtime = parse_key_file(self.path), mtime
                log.info("reloaded %d API keys from %s", len(self._from_file), self.path)
        except (OSError, KeyFileError) as e:
            log.error("keeping the previous API keys: %s", e)


def parse_key_file(path: Path) -> list[ApiKey]:
    where = f"--api-keys-file {path}"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise KeyFileError(f"{where}: cannot read it ({e.strerror or e})") from e
    except yaml.YAMLError as e:
        raise KeyFileError(f"{where}: not valid YAML ({e})") from e
    entries = (data or {}).get("keys") if isinstance(data, dict) else None
    if not entries or not isinstance(entries, list):
        raise KeyFileError(f"{where}: no keys (expected a 'keys:' list of entries)")
    return [_entry(e, i, where) for i, e in enumerate(entries)]


def _entry(e: object, i: int, where: str) -> ApiKey:
    at = f"{where}: keys[{i}]"
    if not isinstance(e, dict) or not isinstance(e.get("key"), str) or len(e["key"]) < 8:
        raise KeyFileError(f"{at}.key: a string of at least 8 characters is required")
    unknown = set(e) - {"key", "name", "priority_ceiling", "rate_limit_rps", "burst",
                        "cache_group"}
    if unknown:
        raise KeyFileError(f"{at}: unknown field {sorted(unknown)[0]!r}")
    ceiling, rps, burst = e.get("priority_ceiling"), e.get("rate_limit_rps"), e.get("burst")
    if ceiling is not None and (isinstance(ceiling, bool) or not isinstance(ceiling, int)):
        raise KeyFileError(f"{at}.priority_ceiling: must be an integer, got {ceiling!r}")
    for name, v in (("rate_limit_rps", rps), ("burst", burst)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise KeyFileError(f"{at}.{name}: must be a number > 0, got {v!r}")
    group = e.get("cache_group")
    if group is not None and (not isinstance(group, str) or not group):
        raise KeyFileError(f"{at}.cache_group: must be a non-empty string, got {group!r}")
    return ApiKey(e["key"].encode(), str(e.get("name") or f"keys[{i}]"), ceiling,
                  None if rps is None else float(rps),
                  float(burst) if burst is not None else max(1.0, float(rps or 1.0)), group)


METRICS_ENV = "TANDEM_METRICS_KEY"
ADMIN_ENV = "TANDEM_ADMIN_KEY"


def load_metrics_key(path: str | None) -> bytes | None:
    """The key /metrics requires: from path (--metrics-key-file), else
    $TANDEM_METRICS_KEY, else None (open)."""
    return _load_key(path, "--metrics-key-file", METRICS_ENV)


def load_admin_key(path: str | None) -> bytes | None:
    """The key the admin endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter)
    require: from path (--admin-key-file), else $TANDEM_ADMIN_KEY, else None (those
    endpoints are off)."""
    return _load_key(path, "--admin-key-file", ADMIN_ENV)


def _load_key(path: str | None, flag: str, env: str) -> bytes | None:
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as e:
            raise KeyFileError(f"{flag} {path}: cannot read it ({e.strerror or e})") from e
        if not value:
            raise KeyFileError(f"{flag} {path}: the file is empty")
        return value.encode()
    value = os.environ.get(env, "").strip()
    return value.encode() or None
