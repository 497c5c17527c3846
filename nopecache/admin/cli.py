"""``nopecache-admin``: the command line over ``nopecache.v1.Admin``.

::

    nopecache-admin [--url URL] [--server HOST:PORT] [--token-file FILE] [--json] VERB ...

    stats   [--tenant T]                       per tier and per tenant
    lookup  PROMPT [--tenant T]                which blocks of a prompt are where
    flush   (--tenant T | --all)               delete a namespace, or everything (admin)
    pin     PROMPT (--hard | --ttl SECONDS)    keep blocks resident
    unpin   PROMPT
    drain   [--wait] [--timeout SECONDS]       leave rotation: refuse Puts, readiness off
    quota   [--tenant T] [--set SIZE]          show; set until restart (admin)

    PROMPT  --keys HEX,...  |  --tokens ID,... | --text TEXT --tokenizer DIR,
            with --model DIR [--model-name N --revision R --dtype D --form nope|rope]
            for --tokens/--text (see prompt.py)

The server and credentials: ``--url`` (else ``$NOPECACHE_CLIENT_URL``, else
``nopecache://127.0.0.1:50551``) is a client URL (TLS: ``nopecaches://``, ``tls_ca_file=``
...). The token: ``--token-file`` > ``$NOPECACHE_ADMIN_TOKEN`` > the URL's ``token=``.
Without ``--tenant``, a tenant token acts on its own tenant; an admin token on the only
tenant, or must name one.

Exit codes: errors.py (0 ok, 2 usage, 3 auth, 4 unavailable, 5 not found, 6 refused,
1 anything else). Errors print one line on stderr naming the problem.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nopecache.admin.connection import AdminConnection, load_config
from nopecache.admin.errors import AdminError, ExitCode
from nopecache.admin.prompt import (
    ModelSpec,
    PromptKey,
    parse_keys,
    parse_token_ids,
    prompt_keys,
    tokenize,
)
from nopecache.admin.render import as_json, percent, size, table
from nopecache.client.config import ClientConfig
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.contract import DEFAULT_PORT
from nopecache.proto.sizes import SizeError, parse_size

__all__ = ["build_parser", "main"]

PROG = "nopecache-admin"
DEFAULT_URL = f"nopecache://127.0.0.1:{DEFAULT_PORT}"
_PIN_NAMES = {0: "-", 1: "soft", 2: "hard"}


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as AdminError (exit 2, one line)."""

    def error(self, message: str) -> Any:
        raise AdminError(ExitCode.USAGE, message)


def _prompt_args(parser: argparse.ArgumentParser) -> None:
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--keys", help="block keys, 32 hex digits each, comma separated")
    given.add_argument("--tokens", help="the prompt's token ids, comma separated")
    given.add_argument("--text", help="the prompt as text (with --tokenizer)")
    parser.add_argument("--tokenizer", help="a tokenizer folder (its tokenizer.json)")
    parser.add_argument("--model", help="the model folder (config.json) the keys are for")
    parser.add_argument("--model-name", help="the engine's model name (default: --model)")
    parser.add_argument("--revision", default="", help="the engine's model revision")
    parser.add_argument("--dtype", help="KV dtype (default: config.json's)")
    parser.add_argument("--form", default="nope", choices=("nope", "rope"))
    parser.add_argument("--tenant", default="", help="whose blocks (admin token)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nopecache-admin``."""
    parser = _Parser(prog=PROG, description="Operate a nopecache server.")
    parser.add_argument(
        "--url", help=f"client URL (default $NOPECACHE_CLIENT_URL or {DEFAULT_URL})"
    )
    parser.add_argument("--server", help="HOST:PORT, when the URL names several servers")
    parser.add_argument("--token-file", help="file holding the bearer token")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    stats = verbs.add_parser("stats", help="statistics per tier and per tenant")
    stats.add_argument("--tenant", default="")

    _prompt_args(verbs.add_parser("lookup", help="where a prompt's blocks are"))

    flush = verbs.add_parser("flush", help="delete a tenant's blocks, or all")
    which = flush.add_mutually_exclusive_group(required=True)
    which.add_argument("--tenant", help="the tenant to flush (a tenant token: itself)")
    which.add_argument("--all", action="store_true", help="every tenant (admin)")
    which.add_argument("--mine", action="store_true", help="the caller's own tenant")

    pin = verbs.add_parser("pin", help="keep a prompt's blocks resident")
    _prompt_args(pin)
    kind = pin.add_mutually_exclusive_group(required=True)
    kind.add_argument("--hard", action="store_true", help="never evicted, never expires")
    kind.add_argument("--ttl", type=float, help="a soft pin for SECONDS (capped by the server)")

    _prompt_args(verbs.add_parser("unpin", help="let a prompt's blocks be evicted again"))

    drain = verbs.add_parser("drain", help="leave rotation: refuse new Puts, readiness off")
    drain.add_argument("--wait", action="store_true", help="return once nothing is in flight")
    drain.add_argument("--wait-timeout", type=float, default=30.0, help="seconds (with --wait)")

    quota = verbs.add_parser("quota", help="show quotas; --set one (admin)")
    quota.add_argument("--tenant", default="")
    quota.add_argument("--set", dest="set_to", help="new quota (e.g. 4GiB; 0: none)")
    return parser


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        try:
            return Path(args.token_file).read_text().strip()
        except FileNotFoundError:
            raise AdminError(
                ExitCode.NOT_FOUND, f"--token-file: no file {args.token_file}"
            ) from None
        except OSError as e:
            raise AdminError(ExitCode.USAGE, f"--token-file: {e.strerror}") from None
    return os.environ.get("NOPECACHE_ADMIN_TOKEN") or None


def _prompt(args: argparse.Namespace, config: ClientConfig) -> tuple[list[PromptKey], bytes]:
    """The keys a PROMPT names and their packed form."""
    if args.keys:
        keys = parse_keys(args.keys)
        found = [PromptKey("key", 0, 0, k) for k in keys]
    else:
        if args.text is not None:
            if not args.tokenizer:
                raise AdminError(ExitCode.USAGE, "--text: needs --tokenizer DIR")
            tokens = tokenize(args.text, args.tokenizer)
        else:
            tokens = parse_token_ids(args.tokens)
        if not args.model:
            raise AdminError(ExitCode.USAGE, "--tokens/--text: needs --model DIR (keys hash it)")
        model = ModelSpec(args.model, args.model_name, args.revision, args.dtype, args.form)
        found = prompt_keys(tokens, model, config)
        if not found:
            raise AdminError(ExitCode.USAGE, "prompt: too short for one block")
    return found, b"".join(k.key for k in found)


def _stats(conn: AdminConnection, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    reply: pb.AdminStatsReply = conn.call("AdminStats", pb.AdminStatsRequest(tenant=args.tenant))
    looked = sum(t.hits for t in reply.tiers) + reply.misses
    tiers = [
        {
            "tier": t.name,
            "url": t.url,
            "entries": t.entries,
            "used_bytes": t.used_bytes,
            "capacity_bytes": t.capacity_bytes,
            "pages": t.pages,
            "hits": t.hits,
            "hit_rate": t.hits / looked if looked else None,
            "evictions": t.evictions,
            "healthy": t.healthy,
        }
        for t in reply.tiers
    ]
    tenants = [
        {
            "tenant": t.tenant,
            "entries": t.entries,
            "used_bytes": t.used_bytes,
            "pages": t.pages,
            "quota_bytes": t.quota_bytes,
            "pinned_entries": t.pinned_entries,
            "pinned_bytes": t.pinned_bytes,
            "hits": t.hits,
            "misses": t.misses,
            "hit_rate": t.hits / (t.hits + t.misses) if t.hits + t.misses else None,
            "in_flight": t.in_flight,
        }
        for t in reply.tenants
    ]
    doc = {
        "server": conn.address,
        "version": reply.server.version,
        "draining": reply.draining,
        "in_flight": reply.in_flight,
        "misses": reply.misses,
        "page_bytes": reply.page_bytes,
        "tiers": tiers,
        "tenants": tenants,
    }
    text = "\n\n".join(
        [
            f"server {conn.address}  version {reply.server.version}  "
            f"{'DRAINING' if reply.draining else 'serving'}  in-flight {reply.in_flight}  "
            f"page {size(reply.page_bytes)}",
            table(
                ["TIER", "ENTRIES", "USED", "CAPACITY", "PAGES", "HITS", "HIT%", "EVICTED", "OK"],
                [
                    [
                        t.name,
                        t.entries,
                        size(t.used_bytes),
                        size(t.capacity_bytes) if t.capacity_bytes else "-",
                        t.pages,
                        t.hits,
                        percent(t.hits, looked),
                        t.evictions,
                        "yes" if t.healthy else "NO",
                    ]
                    for t in reply.tiers
                ],
            ),
            table(
                [
                    "TENANT",
                    "ENTRIES",
                    "USED",
                    "PAGES",
                    "QUOTA",
                    "PINNED",
                    "HITS",
                    "MISSES",
                    "HIT%",
                    "IN-FLIGHT",
                ],
                [
                    [
                        t.tenant,
                        t.entries,
                        size(t.used_bytes),
                        t.pages,
                        size(t.quota_bytes) if t.quota_bytes else "-",
                        f"{t.pinned_entries} ({size(t.pinned_bytes)})",
                        t.hits,
                        t.misses,
                        percent(t.hits, t.hits + t.misses),
                        t.in_flight,
                    ]
                    for t in reply.tenants
                ],
            ),
        ]
    )
    return doc, text


def _lookup(
    conn: AdminConnection, args: argparse.Namespace, config: ClientConfig
) -> tuple[dict[str, Any], str]:
    keys, packed = _prompt(args, config)
    reply: pb.AdminLookupReply = conn.call(
        "AdminLookup", pb.AdminLookupRequest(keys=packed, tenant=args.tenant)
    )
    names = list(reply.tier_names)
    rows = []
    for i, k in enumerate(keys):
        code = reply.tiers[i]
        rows.append(
            {
                "kind": k.kind,
                "start": k.start,
                "end": k.end,
                "key": k.key.hex(),
                "tier": names[code - 1] if code else None,
                "pin": _PIN_NAMES[reply.pins[i]] if reply.pins[i] else None,
                "pin_ttl_s": reply.pin_ttl_ms[i] / 1000 if reply.pin_ttl_ms[i] else None,
            }
        )
    present = sum(1 for r in rows if r["tier"])
    doc = {"server": conn.address, "present": present, "blocks": rows}
    text = table(
        ["KIND", "TOKENS", "KEY", "TIER", "PIN", "TTL"],
        [
            [
                r["kind"],
                f"{r['start']}-{r['end']}" if r["kind"] != "key" else "-",
                r["key"],
                r["tier"] or "-",
                r["pin"] or "-",
                f"{r['pin_ttl_s']:.0f}s" if r["pin_ttl_s"] else "-",
            ]
            for r in rows
        ],
    )
    return doc, f"{text}\n\n{present} of {len(rows)} blocks present"


def _flush(conn: AdminConnection, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    request = pb.FlushRequest(all=True) if args.all else pb.FlushRequest(tenant=args.tenant or "")
    reply: pb.FlushReply = conn.call("Flush", request)
    what = "every tenant" if args.all else f"tenant {args.tenant}" if args.tenant else "own tenant"
    doc = {"flushed": what, "deleted": reply.deleted, "unpinned": reply.unpinned}
    return doc, f"flushed {what}: {reply.deleted} blocks deleted, {reply.unpinned} pins dropped"


def _pin(
    conn: AdminConnection, args: argparse.Namespace, config: ClientConfig
) -> tuple[dict[str, Any], str]:
    if args.ttl is not None and args.ttl <= 0:
        raise AdminError(ExitCode.USAGE, f"--ttl: must be > 0 seconds, got {args.ttl}")
    keys, packed = _prompt(args, config)
    request = pb.PinRequest(
        keys=packed,
        tenant=args.tenant,
        hard=args.hard,
        ttl_ms=0 if args.hard else max(1, round(args.ttl * 1000)),
    )
    reply: pb.PinReply = conn.call("Pin", request)
    kind = "hard" if args.hard else f"soft, {reply.ttl_ms / 1000:g}s"
    doc = {
        "pinned": reply.pinned,
        "missing": reply.missing,
        "kind": "hard" if args.hard else "soft",
        "ttl_s": reply.ttl_ms / 1000 if not args.hard else None,
        "pinned_bytes": reply.pinned_bytes,
    }
    text = (
        f"pinned {reply.pinned} of {len(keys)} blocks ({kind}); {reply.missing} not stored; "
        f"tenant pins {size(reply.pinned_bytes)}"
    )
    return doc, text


def _unpin(
    conn: AdminConnection, args: argparse.Namespace, config: ClientConfig
) -> tuple[dict[str, Any], str]:
    keys, packed = _prompt(args, config)
    reply: pb.UnpinReply = conn.call("Unpin", pb.UnpinRequest(keys=packed, tenant=args.tenant))
    return {"unpinned": reply.unpinned}, f"unpinned {reply.unpinned} of {len(keys)} blocks"


def _drain(conn: AdminConnection, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    timeout_ms = round(args.wait_timeout * 1000)
    # The call may last as long as the wait: its deadline covers it.
    conn.timeout_s = (
        max(conn.timeout_s, args.wait_timeout + conn.timeout_s) if args.wait else conn.timeout_s
    )
    reply: pb.DrainReply = conn.call(
        "Drain", pb.DrainRequest(wait=args.wait, timeout_ms=timeout_ms)
    )
    doc = {"draining": reply.draining, "in_flight": reply.in_flight}
    if args.wait and reply.in_flight:
        raise AdminError(
            ExitCode.FAILED,
            f"{conn.address}: draining, but {reply.in_flight} calls are still in flight after "
            f"{args.wait_timeout:g}s",
        )
    state = "idle" if not reply.in_flight else f"{reply.in_flight} calls in flight"
    return doc, f"{conn.address}: draining (new Puts refused, readiness NOT_SERVING); {state}"


def _quota(conn: AdminConnection, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    if args.set_to is not None:
        if not args.tenant:
            raise AdminError(ExitCode.USAGE, "quota --set: needs --tenant")
        try:
            quota = parse_size(args.set_to, field="--set")
        except SizeError as e:
            raise AdminError(ExitCode.USAGE, str(e)) from None
        reply: pb.QuotaReply = conn.call(
            "SetQuota", pb.SetQuotaRequest(tenant=args.tenant, quota_bytes=quota)
        )
    else:
        reply = conn.call("GetQuota", pb.GetQuotaRequest(tenant=args.tenant))
    rows = [
        {
            "tenant": q.tenant,
            "quota_bytes": q.quota_bytes,
            "used_bytes": q.used_bytes,
            "pinned_bytes": q.pinned_bytes,
        }
        for q in reply.tenants
    ]
    text = table(
        ["TENANT", "QUOTA", "USED", "PINNED"],
        [
            [
                q.tenant,
                size(q.quota_bytes) if q.quota_bytes else "-",
                size(q.used_bytes),
                size(q.pinned_bytes),
            ]
            for q in reply.tenants
        ],
    )
    return {"tenants": rows}, text


def run(argv: Sequence[str] | None) -> tuple[dict[str, Any], str, bool]:
    """Parse ``argv`` and run the verb: (JSON document, text, whether --json)."""
    args = build_parser().parse_args(argv)
    url = args.url or os.environ.get("NOPECACHE_CLIENT_URL") or DEFAULT_URL
    config = load_config(url, args.server, _token(args))
    if args.timeout <= 0:
        raise AdminError(ExitCode.USAGE, f"--timeout: must be > 0 seconds, got {args.timeout}")
    conn = AdminConnection(config, args.timeout)
    try:
        if args.verb == "stats":
            doc, text = _stats(conn, args)
        elif args.verb == "lookup":
            doc, text = _lookup(conn, args, config)
        elif args.verb == "flush":
            doc, text = _flush(conn, args)
        elif args.verb == "pin":
            doc, text = _pin(conn, args, config)
        elif args.verb == "unpin":
            doc, text = _unpin(conn, args, config)
        elif args.verb == "drain":
            doc, text = _drain(conn, args)
        else:
            doc, text = _quota(conn, args)
    finally:
        conn.close()
    return doc, text, args.json


def main(argv: Sequence[str] | None = None) -> int:
    """``nopecache-admin`` entry point: the exit status (errors.py)."""
    try:
        doc, text, as_doc = run(argv)
    except AdminError as e:
        print(f"{PROG}: {e.message}", file=sys.stderr)
        return int(e.code)
    print(as_json(doc) if as_doc else text)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
