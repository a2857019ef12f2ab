//! `--wait`: polls the DI and its events every second and shows progress on stderr until the
//! goal is reached, the DI ends in `error`, or the timeout passes.

use std::io::Write;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::client::{Client, Id, Listing};
use crate::Failure;

const POLL: Duration = Duration::from_secs(1);
const SPINNER: &[char] = &['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Goal {
    /// `status == active && pending_deployment_spec == null`.
    Ready,
    /// The DI answers 404.
    Gone,
}

pub enum Outcome {
    /// Reached the goal; the last state seen (none for `Gone`).
    Done(Option<Value>),
    /// The DI ended in `error`; the last state and the reason.
    Failed(Option<Value>, String),
    /// The timeout passed; the last state seen.
    TimedOut(Option<Value>),
}

/// The events already shown (or that predate the operation), so only newer ones are printed.
#[derive(Default)]
pub struct EventCursor {
    /// Events seen so far, in list order: the next new one is at this index.
    seen: usize,
    /// The highest event id seen.
    last_id: i64,
    /// The newest event with phase `error`, as "Reason: message".
    last_error: Option<String>,
}

impl EventCursor {
    /// Marks every event that exists now as seen. Errors are ignored: the snapshot only keeps
    /// old events off the screen.
    pub async fn snapshot(client: &Client, id: &Id) -> EventCursor {
        let mut cursor = EventCursor::default();
        let _ = cursor.fetch(client, id).await;
        cursor.last_error = None;
        cursor
    }

    /// Fetches the events after the cursor and advances it.
    async fn fetch(&mut self, client: &Client, id: &Id) -> Result<Vec<Value>, Failure> {
        let per_page = client.per_page();
        let mut fresh = Vec::new();
        let mut page = self.seen / per_page + 1;
        loop {
            let answer = client.events(id, page).await?;
            let (items, total) = (answer.items(), answer.typed.total().max(0) as usize);
            let full = items.len() == per_page;
            self.seen = self.seen.max((page - 1) * per_page + items.len());
            for e in items {
                let eid = e["id"].as_i64().unwrap_or(0);
                if eid > self.last_id {
                    self.last_id = eid;
                    fresh.push(e);
                }
            }
            if !full || page * per_page >= total {
                break;
            }
            page += 1;
        }
        for e in &fresh {
            if e["phase"] == "error" {
                self.last_error = Some(event_text(e));
            }
        }
        Ok(fresh)
    }
}

fn event_text(e: &Value) -> String {
    format!(
        "{}: {}",
        e["reason"].as_str().unwrap_or("event"),
        e["message"].as_str().unwrap_or("")
    )
}

pub fn elapsed(d: Duration) -> String {
    let secs = d.as_secs();
    if secs >= 3600 {
        format!("{}h{:02}m{:02}s", secs / 3600, secs / 60 % 60, secs % 60)
    } else if secs >= 60 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else {
        format!("{secs}s")
    }
}

/// Where progress goes: one redrawn line on a terminal, a line per change otherwise.
struct Progress {
    tty: bool,
    /// Whether a status line is on screen (terminal only).
    drawn: bool,
    /// The last state printed (line mode only).
    last: Option<String>,
    frame: usize,
}

impl Progress {
    fn clear(&mut self) {
        if self.tty && self.drawn {
            eprint!("\r\x1b[2K");
            self.drawn = false;
        }
    }

    fn event(&mut self, started: Instant, e: &Value) {
        self.clear();
        eprintln!(
            "[{:>6}] {} {}",
            elapsed(started.elapsed()),
            e["phase"].as_str().unwrap_or("-"),
            event_text(e)
        );
    }

    fn state(&mut self, started: Instant, state: &str) {
        if self.tty {
            self.clear();
            let spin = SPINNER[self.frame % SPINNER.len()];
            self.frame += 1;
            let line = format!("{spin} {state}  {}", elapsed(started.elapsed()));
            // Keep to one terminal row so `\r` can redraw it.
            let line: String = line
                .chars()
                .take(terminal_width().saturating_sub(1))
                .collect();
            eprint!("{line}");
            let _ = std::io::stderr().flush();
            self.drawn = true;
        } else if self.last.as_deref() != Some(state) {
            eprintln!("[{:>6}] {state}", elapsed(started.elapsed()));
            self.last = Some(state.to_string());
        }
    }

    fn note(&mut self, started: Instant, text: &str) {
        self.clear();
        eprintln!("[{:>6}] {text}", elapsed(started.elapsed()));
    }
}

fn terminal_width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .filter(|&c: &usize| c >= 20)
        .unwrap_or(100)
}

/// A one-line summary of where the DI stands: status and the phase of a pending rollout.
fn describe(di: &Value) -> String {
    let mut text = format!("status {}", di["status"].as_str().unwrap_or("?"));
    let pending = &di["pending_deployment_spec"];
    if di["status"] == "deleting" {
        // The version no longer matters.
    } else if pending.is_object() {
        text.push_str(&format!(
            ", version {} {}",
            crate::render::s(&pending["version"]),
            pending["status"].as_str().unwrap_or("pending")
        ));
    } else {
        text.push_str(&format!(
            ", version {}",
            crate::render::s(&di["spec"]["version"])
        ));
    }
    text
}

/// Polls until `goal`, `error` or `timeout`. Transient trouble (5xx, unreachable) is reported
/// and polling goes on until the timeout; other API errors end the wait.
pub async fn wait(
    client: &Client,
    id: &Id,
    goal: Goal,
    timeout: Duration,
    mut cursor: EventCursor,
) -> Result<Outcome, Failure> {
    let started = Instant::now();
    let mut progress = Progress {
        tty: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        drawn: false,
        last: None,
        frame: 0,
    };
    let mut last: Option<Value> = None;
    let mut trouble = false;
    loop {
        let tick = Instant::now();
        let got = client.get(id).await;
        let di = match got {
            Ok(answer) => {
                trouble = false;
                Some(answer.body["dedicated_inference"].clone())
            }
            Err(Failure::Api { status: 404, .. }) if goal == Goal::Gone => {
                // Show the last events (e.g. "Deleted") if they are still readable; they are not
                // once the DI is gone, which is fine.
                progress.clear();
                return Ok(Outcome::Done(None));
            }
            Err(e) if e.transient() => {
                if !trouble {
                    progress.note(started, &format!("{e}; still waiting"));
                    trouble = true;
                }
                None
            }
            Err(e) => {
                progress.clear();
                return Err(e);
            }
        };
        if di.is_some() {
            match cursor.fetch(client, id).await {
                Ok(fresh) => {
                    for e in &fresh {
                        progress.event(started, e);
                    }
                }
                Err(Failure::Api { status: 404, .. }) if goal == Goal::Gone => {}
                Err(e) if e.transient() => {}
                Err(e) => {
                    progress.clear();
                    return Err(e);
                }
            }
        }
        if let Some(di) = di {
            let status = di["status"].as_str().unwrap_or("");
            if goal == Goal::Ready && status == "active" && di["pending_deployment_spec"].is_null()
            {
                progress.clear();
                return Ok(Outcome::Done(Some(di)));
            }
            if status == "error" {
                progress.clear();
                let reason = cursor
                    .last_error
                    .clone()
                    .unwrap_or_else(|| "the dedicated inference is in status error".into());
                return Ok(Outcome::Failed(Some(di), reason));
            }
            progress.state(started, &describe(&di));
            last = Some(di);
        }
        if started.elapsed() >= timeout {
            progress.clear();
            return Ok(Outcome::TimedOut(last));
        }
        let spent = tick.elapsed();
        let remaining = timeout.saturating_sub(started.elapsed());
        tokio::time::sleep(POLL.saturating_sub(spent).min(remaining)).await;
    }
}
