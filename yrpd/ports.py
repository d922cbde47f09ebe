"""Port blocks: an instance whose ranks each need a port of one kind gets a block of them, counted from that kind's
base (`ports.hccl_base`, `ports.mooncake_base`) by the instance's slot on its host. A leaf module, so the placement
and the connectors' port rules (yrpd.ascend_store) read the same size without importing each other."""

#: ports in an instance's block: room for tp x dp ranks of one instance on one host
INSTANCE_PORT_BLOCK = 16

#: ports of one Ray node of an instance spanning hosts (multi_node_backend ray), from ray_base + RAY_PORT_BLOCK x its
#: slot on that host: GCS (the head's), node manager, object manager, runtime-env agent, dashboard agent (gRPC and
#: HTTP), metrics export, Ray client server. Ray's worker processes take its own default range (10002-19999).
RAY_PORT_BLOCK = 8
