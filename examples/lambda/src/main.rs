//! The Lambda function: the store from the environment, then `lambda_http::run` serves
//! the API one invocation at a time.

use std::sync::Arc;

use idem_example_lambda::{Workers, app, store_from_env};

#[tokio::main]
async fn main() -> Result<(), lambda_http::Error> {
    let store = store_from_env().await?;
    lambda_http::run(app(Arc::new(store), Workers::default())).await
}
