"""Port blocks: an instance whose ranks each need a port of one kind gets a block of them, counted from that kind's
base (`ports.hccl_base`, `ports.mooncake_base`) by the instance's slot on its host. A leaf module, so the placement
and the connectors' port rules (yrpd.ascend_store) read the same size without importing each other."""

#: ports in an instance's block: room for tp x dp ranks of one instance on one host
INSTANCE_PORT_BLOCK = 16
