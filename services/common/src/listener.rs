//! The TCP listener every HTTP service serves on.

use axum::serve::{ListenerExt, TapIo};
use tokio::net::{TcpListener, TcpStream};

/// `listener`, with `TCP_NODELAY` on every accepted connection: an API answers small requests on
/// kept-alive connections, and Nagle's algorithm would hold a response's last small segment until
/// the previous one is acknowledged (up to a delayed-ACK timeout on the client).
pub fn no_delay(listener: TcpListener) -> TapIo<TcpListener, fn(&mut TcpStream)> {
    listener.tap_io(|stream: &mut TcpStream| {
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "could not set TCP_NODELAY");
        }
    })
}
