"""``python -m agoractl``: the same command line as the ``agoractl`` console script."""

from agoractl.cli.main import run

if __name__ == "__main__":
    run()
