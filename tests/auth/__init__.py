"""Tests of agoractl.auth: keys, credentials, placement (pure, in-memory)."""
