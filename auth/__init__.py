"""Trust between Tandem's processes and at its edge: the cluster secret and the HMAC
tokens every internal RPC carries (secret.py, tokens.py, grpc_auth.py), and the API
keys clients present to the router (keys.py). Depends on nothing else of Tandem, so
every layer may import it."""
