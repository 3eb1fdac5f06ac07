"""Tests of the Authorizer service."""
