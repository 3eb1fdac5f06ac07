"""``agoractl launch authorizer FILE``: the run's Authorizer service. Registered on the ``launch`` group."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from agoractl.auth import keys
from agoractl.cli.common import ManifestArg, SetOpt, load
from agoractl.cli.launch import app
from agoractl.cli.output import note


@app.command(epilog="Examples:\n\n  AGORA_AUTHORITY_KEY=authority.key agoractl launch authorizer run.yaml\n\n"
                    "  AGORA_DATABASE_URL=postgresql://agora@db/agora AGORA_REDIS_URL=redis://cache:6379/0 \\\n"
                    "  AGORA_AUTHORITY_KEY=authority.key agoractl launch authorizer run.yaml --host 0.0.0.0")
def authorizer(
    manifest: ManifestArg,
    set_: SetOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port to listen on.", min=1, max=65535)] = 8470,
) -> None:
    """The Authorizer (report §3.6.1): admission, stage placement, signed credentials, for this manifest's run.
    PostgreSQL from AGORA_DATABASE_URL (default SQLite under local.run_dir/authorizer), Redis from
    AGORA_REDIS_URL (default in-process), the private key from AGORA_AUTHORITY_KEY. Serves until Ctrl-C."""
    run = load(manifest, set_)
    from agoractl.services.authorizer.server import Settings, build, serve  # fastapi, sqlalchemy: not for workers

    settings = Settings.from_env(run)
    app_, auth = build(run, settings)
    note(f"authorizer: run {run.metadata.name} on http://{host}:{port} "
         f"(database {auth.engine.url.render_as_string(hide_password=True)}, "
         f"{'redis' if settings.redis_url else 'in-process state'})")
    serve(app_, host, port)


def loopback_authorizer(run, manifest, set_):
    """For `launch swarm` with admission on and no admission.authorizer: an Authorizer in this process on
    loopback (SQLite under local.run_dir/authorizer, in-process state; the key from AGORA_AUTHORITY_KEY, else a
    fresh one for this swarm). Returns (run, overrides, server) with the nodes pointed at it; server None when
    not needed."""
    if not run.admission.enabled or run.admission.authorizer:
        return run, set_, None
    from agoractl.services.authorizer.server import Background, Settings, build  # only when one is needed

    key = keys.load_private() if os.environ.get(keys.KEY_ENV) else keys.generate()
    app_, _ = build(run, Settings.from_env(run), key=key)
    server = Background(app_)
    set_ = [*(set_ or []), f"admission.authorizer={server.url}",
            f"admission.authority_public_key={keys.public_text(key)}"]
    note(f"authorizer: {server.url} (run {run.metadata.name}, every node joins through it)")
    return load(manifest, set_), set_, server
