//! Serves `idem.example.Workers/Create` behind the idempotency layer on a loopback port,
//! then calls it twice with one key through a tonic client: one execution, one reply.
//!
//! `cargo run -p idem-example-grpc`

use std::sync::Arc;

use idem_core::MemoryStore;
use idem_example_grpc::{CreateWorker, Workers, WorkersClient, router};
use idem_http::IdempotencyLayer;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let workers = Workers::new();
    let app = router(workers.clone(), IdempotencyLayer::new(Arc::new(MemoryStore::new())));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });

    let mut client = WorkersClient::connect(format!("http://{addr}")).await?;
    let msg = CreateWorker { name: "gpu-7".into(), size: "large".into() };
    for attempt in 1..=2 {
        let res = client.create(msg.clone(), Some("create-gpu-7"), Some("ops")).await?;
        let replayed = res.metadata().get("idempotent-replayed").is_some();
        println!("attempt {attempt}: {:?} (replayed: {replayed})", res.into_inner());
    }
    println!("executions: {}", workers.executions());
    Ok(())
}
