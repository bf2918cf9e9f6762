//! The consumer examples against the real brokers and PostgreSQL (`--features live-tests`):
//! NATS with JetStream at `IDEM_NATS_URL` (default `127.0.0.1:4222`), RabbitMQ at
//! `IDEM_AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`), PostgreSQL at
//! `IDEM_POSTGRES_URL`. `scripts/services` starts them; without them these fail.

#[cfg(feature = "live-tests")]
mod amqp;
#[cfg(feature = "live-tests")]
mod killed;
#[cfg(feature = "live-tests")]
mod nats;
