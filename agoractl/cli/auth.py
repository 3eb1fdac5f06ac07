"""``agoractl auth ...``: the authority's key pair, and operating a running Authorizer (policy, report,
nodes, bans, accounts). Thin: parse, call the service, render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from agoractl.auth import keys
from agoractl.cli.common import JsonOpt, ManifestArg, SetOpt, load
from agoractl.cli.output import emit, stdout
from agoractl.errors import UsageError
from agoractl.manifest.loader import apply_overrides
from agoractl.services.authorizer.client import AdminClient, authorizer_url

app = typer.Typer(help="The authority's keys and a running Authorizer: policy, report, nodes, bans.",
                  no_args_is_help=True)
policy_app = typer.Typer(help="Show or change the live admission policy (applies to the next request).",
                         no_args_is_help=True)
app.add_typer(policy_app, name="policy")

UrlOpt = Annotated[Optional[str], typer.Option(
    "--authorizer", help="The Authorizer's URL; default admission.authorizer.", show_default=False)]


def _client(manifest: Path, set_, url: Optional[str]) -> AdminClient:
    run = load(manifest, set_)
    return AdminClient(run, authorizer_url(run, url))


@app.command(epilog="Example:\n\n  agoractl auth keygen ~/.agora/authority.key\n\n"
                    "  export AGORA_AUTHORITY_KEY=~/.agora/authority.key")
def keygen(path: Annotated[Path, typer.Argument(help="Where to write the private key (PATH.pub: public).")],
           force: Annotated[bool, typer.Option("--force", help="Overwrite an existing key.")] = False,
           as_json: JsonOpt = False) -> None:
    """Make the authority's Ed25519 key pair: the private key (mode 0600) and its one-line public key, which
    goes into admission.authority_public_key."""
    priv, pub, key = keys.write_pair(path, force=force)
    out = {"private_key": str(priv), "public_key_file": str(pub), "public_key": keys.public_text(key),
           "key_id": keys.key_id(key)}
    emit(out, as_json, lambda o: stdout.print(f"private key: {o['private_key']} (keep it secret; "
                                              f"export AGORA_AUTHORITY_KEY={o['private_key']})\n"
                                              f"public key:  {o['public_key']}"))


@policy_app.command("show")
def policy_show(manifest: ManifestArg, set_: SetOpt = None, authorizer: UrlOpt = None, as_json: JsonOpt = False):
    """The live admission policy."""
    emit(_client(manifest, set_, authorizer).call("GET", "/v1/policy"), True)


@policy_app.command("set", epilog="Example:\n\n  agoractl auth policy set run.yaml max_contributors=80 "
                                  "'contributor_stages=[body-1, body-2]' checks.integrity=true")
def policy_set(manifest: ManifestArg,
               changes: Annotated[list[str], typer.Argument(help="FIELD=VALUE of the admission section (dotted "
                                                                  "for checks.*), YAML values.")],
               set_: SetOpt = None, authorizer: UrlOpt = None, as_json: JsonOpt = False) -> None:
    """Change the live policy; the Authorizer validates it and applies it to the very next request."""
    patch: dict = {}
    try:
        apply_overrides(patch, changes)
    except UsageError as e:
        raise UsageError(e.message.replace("--set ", ""), hint="write FIELD=VALUE, e.g. max_contributors=80") from None
    new = _client(manifest, set_, authorizer).call("PATCH", "/v1/policy", patch)
    emit(new, as_json, lambda p: stdout.print("policy now: " + ", ".join(f"{k}={p[k]}" for k in sorted(patch))))


@app.command(epilog="Example:\n\n  agoractl auth report run.yaml --json")
def report(manifest: ManifestArg, set_: SetOpt = None, authorizer: UrlOpt = None, as_json: JsonOpt = False) -> None:
    """Refusals by reason code (report §5.3.3) and each admitted node's waiting time."""
    emit(_client(manifest, set_, authorizer).call("GET", "/v1/report"), as_json, _render_report)


def _render_report(r: dict) -> None:
    stdout.print(f"{r['run']}: {r['admitted']} admitted, {r['refused']} refused or held, queue {r['queue_length']}")
    for reason, n in sorted(r["reasons"].items(), key=lambda kv: -kv[1]):
        stdout.print(f"  {reason:<20} {n:>6}  {100 * r['shares'][reason]:5.1f}%")
    if r["waiting"]:
        waits = sorted(w["wait_s"] for w in r["waiting"])
        stdout.print(f"waiting time: median {waits[len(waits) // 2]:.1f} s, max {waits[-1]:.1f} s "
                     f"over {len(waits)} nodes")


@app.command(epilog="Example:\n\n  agoractl auth nodes run.yaml")
def nodes(manifest: ManifestArg, set_: SetOpt = None, authorizer: UrlOpt = None, as_json: JsonOpt = False) -> None:
    """Who is admitted where (and who waits, left, expired or is banned)."""
    emit(_client(manifest, set_, authorizer).call("GET", "/v1/nodes"), as_json, _render_nodes)


def _render_nodes(rows: list[dict]) -> None:
    stdout.print(f"{'node':<24} {'role':<8} {'stage':<10} {'status':<9} peer")
    for n in rows:
        stdout.print(f"{n['node_id']:<24} {n['role']:<8} {n['stage'] or '-':<10} {n['status']:<9} {n['peer_id']}")


@app.command(epilog="Example:\n\n  agoractl auth ban run.yaml worker-7\n\n"
                    "  agoractl auth ban run.yaml mallory --account")
def ban(manifest: ManifestArg, subject: Annotated[str, typer.Argument(help="Node id (or account with --account).")],
        account: Annotated[bool, typer.Option("--account", help="Ban a whole account.")] = False,
        reason: Annotated[str, typer.Option(help="Why, kept in the record.")] = "",
        set_: SetOpt = None, authorizer: UrlOpt = None, as_json: JsonOpt = False) -> None:
    """Bar a node or account: no admission, no renewal; its nodes drop out when their credential expires."""
    _client(manifest, set_, authorizer).call("POST", "/v1/bans", {"subject": subject, "reason": reason,
                                                                   "kind": "account" if account else "node"})
    emit({"banned": subject, "kind": "account" if account else "node"}, as_json,
         lambda o: stdout.print(f"banned {o['kind']} {o['banned']}"))


@app.command(epilog="Example:\n\n  agoractl auth account run.yaml alice --operator")
def account(manifest: ManifestArg, name: Annotated[str, typer.Argument(help="Account name.")],
            operator: Annotated[bool, typer.Option("--operator", help="An operator's account.")] = False,
            set_: SetOpt = None, authorizer: UrlOpt = None, as_json: JsonOpt = False) -> None:
    """Create (or reset) an account; prints its token once (nodes pass it as AGORA_ACCOUNT_TOKEN)."""
    out = _client(manifest, set_, authorizer).call("POST", "/v1/accounts", {"name": name, "operator": operator})
    emit(out, as_json, lambda o: stdout.print(f"account {o['name']}: token {o['token']} (shown once)"))
