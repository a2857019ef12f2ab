//! A TCP proxy in front of a regional service, to make it slow (responses held back) or down
//! (connections refused, open ones cut) without touching its code.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    Pass,
    /// Requests reach the region at once; its answers are held back this long.
    SlowResponses(Duration),
    /// New connections are dropped before anything is forwarded, and open ones are cut.
    Down,
}

pub struct Proxy {
    pub addr: SocketAddr,
    upstream: Arc<Mutex<SocketAddr>>,
    mode: watch::Sender<Mode>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let upstream = Arc::new(Mutex::new(upstream));
        let (mode, _) = watch::channel(Mode::Pass);
        let (shared_upstream, modes) = (upstream.clone(), mode.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let target = *shared_upstream.lock().unwrap();
                tokio::spawn(forward(client, target, modes.subscribe()));
            }
        });
        Proxy {
            addr,
            upstream,
            mode,
            task,
        }
    }

    pub fn set_mode(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self.upstream.lock().unwrap() = upstream;
    }
}

async fn forward(client: TcpStream, upstream: SocketAddr, mut modes: watch::Receiver<Mode>) {
    if *modes.borrow_and_update() == Mode::Down {
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let pipe = pipe(client, server, modes.clone());
    let cut = async {
        loop {
            if modes.changed().await.is_err() || *modes.borrow() == Mode::Down {
                return;
            }
        }
    };
    tokio::select! {
        _ = pipe => {}
        _ = cut => {}
    }
}

async fn pipe(mut client: TcpStream, mut server: TcpStream, modes: watch::Receiver<Mode>) {
    let (mut cr, mut cw) = client.split();
    let (mut sr, mut sw) = server.split();
    let up = async {
        let _ = tokio::io::copy(&mut cr, &mut sw).await;
        let _ = sw.shutdown().await;
    };
    let down = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mode = *modes.borrow();
            if let Mode::SlowResponses(delay) = mode {
                // The fault itself: a region that answers late, as slow as the test asks.
                tokio::time::sleep(delay).await;
            }
            if cw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = cw.shutdown().await;
    };
    tokio::join!(up, down);
}
