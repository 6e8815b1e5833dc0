"""What ``aiomm serve`` does to its own process and sockets, and nothing embedded does: the HTTP
protocol that writes responses straight to the socket (:mod:`.protocol`), the supervisor of
``--workers N`` (:mod:`.supervisor`), their connection balance (:mod:`.balance`), core pinning
(:mod:`.pinning`) and the settled process (:mod:`.settle`)."""
