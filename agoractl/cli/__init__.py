"""The ``agoractl`` command line: a short root (:mod:`.main`) and one module per command group."""
