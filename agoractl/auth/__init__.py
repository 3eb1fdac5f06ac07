"""Who may take part in a run: the authority's Ed25519 keys, signed short-lived credentials bound to a
node's libp2p peer id, and stage placement. Pure: no networking, no database (report §3.6.1)."""
