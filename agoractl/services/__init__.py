"""Long-running network services of a run (above the runtime, below the CLI): the Authorizer."""
