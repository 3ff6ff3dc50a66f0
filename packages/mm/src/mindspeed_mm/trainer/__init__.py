"""The one FSDP2 trainer of every MM model: mesh, sharding plan, precision, loss, optimizer, checkpoints, export."""
