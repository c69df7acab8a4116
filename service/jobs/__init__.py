"""Job specs, the SQLite store and the FIFO job manager."""
