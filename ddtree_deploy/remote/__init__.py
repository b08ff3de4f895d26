"""Controller-side clients of the host helper, one per hostside/ module with ops: the only callers of the transport.

Each function takes the `Transport` of one host, makes one round trip and returns the answer typed
(protocol.py for the host's state records, the module's own models for its ops' answers), or
raises the `DeployError` a refusal maps to. Nothing here decides what to do next.
"""
