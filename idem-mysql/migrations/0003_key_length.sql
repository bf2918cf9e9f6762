-- idem-mysql migration 3: the key column without a length of its own.
--
-- `{prefix}` is replaced by the configured table prefix before this runs. Keys are 255
-- bytes by default, but the application sets the limit (`IdempotencyKey::parse_with_limit`),
-- and a server outside strict SQL mode would truncate a longer key silently. Running it
-- again changes nothing, so a crash before its bookkeeping row is harmless. The same
-- statement on MySQL 8 and MariaDB 10.11.
ALTER TABLE `{prefix}_records` MODIFY idem_key LONGBLOB NOT NULL
