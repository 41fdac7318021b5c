"""The control plane between a trainer and its engines, above both sides: the clients a
sender reaches its engines through (`clients`: in process, HTTP, a fleet) and a receiver
served to another process (`rpc`: `ReceiverServer`, `RPCClient`). `wtransfer.rpc` is this
`rpc`; the old module paths `wtransfer.clients` and `wtransfer.rpc` still import."""
