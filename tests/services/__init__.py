"""Tests of agoractl.services."""
