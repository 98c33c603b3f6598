//! The lighthouse's HTML dashboard, rendered from a [`LighthouseStatus`].
//!
//! One self-contained page (no external scripts or styles): the server
//! renders everything, so a plain HTTP client sees the whole state; a small
//! inline script re-fetches the page every second and swaps the
//! `#dashboard` element, and turns the kill buttons into `fetch` POSTs whose
//! outcome it shows in `#kill-result`. Without JavaScript, a `<noscript>`
//! meta refresh reloads the page and the kill buttons post their forms.
//! Every string that comes from a replica is escaped.
//!
//! The lists (previous quorum, joined replicas, heartbeats) are paged:
//! `GET /?page=N` (from 0) shows [`PAGE_SIZE`] entries of each. The kill
//! forms and the script carry the server's kill token (also in a
//! `<meta name="ferry-kill-token">`), which a page of another origin
//! cannot read; the server refuses a kill without it. Nor can a page whose
//! name was rebound to the lighthouse's address (DNS rebinding): the
//! server answers only requests for its own names (`super::host`).

use std::net::SocketAddr;

use super::status::{KillOutcome, LighthouseStatus, MemberStatus};

/// Entries of each list on one dashboard page.
pub const PAGE_SIZE: usize = 50;

/// The dashboard page `page` (from 0) for `status`, served by the
/// lighthouse at `addr`, whose kills need `token`.
pub(crate) fn render_page(
    status: &LighthouseStatus,
    addr: SocketAddr,
    token: &str,
    page: usize,
) -> String {
    let mut html = String::with_capacity(16 * 1024);
    html.push_str(&HEAD.replace(
        "<title>",
        &format!(
            "<meta name=\"ferry-kill-token\" content=\"{}\">\n<title>",
            escape(token)
        ),
    ));
    html.push_str(&format!(
        "<header><h1>Lighthouse Dashboard &mdash; Ferry</h1><span class=\"addr\">{}</span></header>\n",
        escape(&addr.to_string())
    ));
    html.push_str("<main id=\"dashboard\">\n");
    render_summary(&mut html, status);
    let longest = [
        status.prev_quorum.as_ref().map_or(0, |q| q.members.len()),
        status.participants.len(),
        status.heartbeats.len(),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    let pages = longest.div_ceil(PAGE_SIZE).max(1);
    let page = page.min(pages - 1);
    let view = View { token, page };
    render_pages(&mut html, page, pages);
    render_prev_quorum(&mut html, status, &view);
    render_participants(&mut html, status, &view);
    render_heartbeats(&mut html, status, &view);
    render_last_kill(&mut html, status.last_kill.as_ref());
    html.push_str("</main>\n");
    html.push_str("<section><p id=\"kill-result\" role=\"status\"></p></section>\n");
    html.push_str(SCRIPT);
    html.push_str("</body>\n</html>\n");
    html
}

fn render_summary(html: &mut String, status: &LighthouseStatus) {
    let options = &status.options;
    let (ready_class, ready_text) = if status.next_quorum_ready {
        ("ready", "ready")
    } else {
        ("waiting", "not ready")
    };
    html.push_str(&format!(
        "<section class=\"summary\">\n\
         <div class=\"stat\"><span class=\"label\">Quorum ID</span><span class=\"value\" id=\"quorum-id\">{quorum_id}</span></div>\n\
         <div class=\"stat\"><span class=\"label\">Members</span><span class=\"value\" id=\"num-participants\">{members}</span></div>\n\
         <div class=\"stat\"><span class=\"label\">Max step</span><span class=\"value\" id=\"max-step\">{max_step}</span></div>\n\
         <div class=\"stat\"><span class=\"label\">Waiting</span><span class=\"value\" id=\"num-waiting\">{waiting}</span></div>\n\
         <p class=\"next {ready_class}\">Next quorum: <strong>{ready_text}</strong> &mdash; <code id=\"quorum-status\">{reason}</code></p>\n\
         <p class=\"options\">min_replicas {min_replicas} &middot; join_timeout {join} ms &middot; quorum_tick {tick} ms &middot; heartbeat_timeout {hb} ms</p>\n\
         </section>\n",
        quorum_id = status.quorum_id,
        members = if status.num_participants < 0 {
            "&ndash;".to_owned()
        } else {
            status.num_participants.to_string()
        },
        max_step = if status.max_step < 0 {
            "&ndash;".to_owned()
        } else {
            status.max_step.to_string()
        },
        waiting = status.participants.len(),
        reason = escape(&status.quorum_status),
        min_replicas = options.min_replicas,
        join = options.join_timeout_ms,
        tick = options.quorum_tick_ms,
        hb = options.heartbeat_timeout_ms,
    ));
}

/// What every list needs: the kill token and the page shown.
struct View<'a> {
    token: &'a str,
    page: usize,
}

impl View<'_> {
    /// The entries of `list` on this page.
    fn page_of<'l, T>(&self, list: &'l [T]) -> &'l [T] {
        let start = (self.page * PAGE_SIZE).min(list.len());
        &list[start..(start + PAGE_SIZE).min(list.len())]
    }
}

fn render_pages(html: &mut String, page: usize, pages: usize) {
    html.push_str(&format!(
        "<section id=\"pages\"><p>Page <span id=\"page\">{}</span> of <span id=\"pages-count\">{pages}</span>",
        page + 1
    ));
    if page > 0 {
        html.push_str(&format!(
            " &middot; <a id=\"prev-page\" href=\"/?page={}\">previous</a>",
            page - 1
        ));
    }
    if page + 1 < pages {
        html.push_str(&format!(
            " &middot; <a id=\"next-page\" href=\"/?page={}\">next</a>",
            page + 1
        ));
    }
    html.push_str("</p></section>\n");
}

fn render_prev_quorum(html: &mut String, status: &LighthouseStatus, view: &View<'_>) {
    html.push_str("<section id=\"prev-quorum\">\n");
    match &status.prev_quorum {
        None => html.push_str("<h2>Previous quorum</h2>\n<p class=\"empty\">No quorum yet.</p>\n"),
        Some(quorum) => {
            let formed = quorum
                .age_ms
                .map(|age| format!(", formed {} ago", age_text(age)))
                .unwrap_or_default();
            html.push_str(&format!(
                "<h2>Previous quorum <span class=\"muted\">(id {}, {} members, max step {}{})</span></h2>\n",
                quorum.quorum_id,
                quorum.members.len(),
                quorum.max_step,
                formed
            ));
            render_members(html, view.page_of(&quorum.members), false, view.token);
        }
    }
    html.push_str("</section>\n");
}

fn render_participants(html: &mut String, status: &LighthouseStatus, view: &View<'_>) {
    html.push_str("<section id=\"participants\">\n<h2>Joined the next round</h2>\n");
    if status.participants.is_empty() {
        html.push_str("<p class=\"empty\">No replica is waiting for the next quorum.</p>\n");
    } else {
        render_members(html, view.page_of(&status.participants), true, view.token);
    }
    html.push_str("</section>\n");
}

fn render_members(html: &mut String, members: &[MemberStatus], joined: bool, token: &str) {
    html.push_str(
        "<table class=\"members\">\n<thead><tr><th>Replica</th><th>Step</th><th>Manager address</th>\
         <th>Store address</th><th>World size</th><th>State</th><th>Heartbeat</th>",
    );
    if joined {
        html.push_str("<th>Joined</th>");
    }
    html.push_str("<th></th></tr></thead>\n<tbody>\n");
    for member in members {
        let id = escape(&member.replica_id);
        let mut state = if member.recovering {
            "<span class=\"badge recovering\">recovering</span>".to_owned()
        } else {
            "<span class=\"badge ok\">up to date</span>".to_owned()
        };
        if member.shrink_only {
            state.push_str(" <span class=\"badge\">shrink only</span>");
        }
        if member.commit_failures > 0 {
            state.push_str(&format!(
                " <span class=\"badge failed\">{} commit failures</span>",
                member.commit_failures
            ));
        }
        let heartbeat = match member.heartbeat_age_ms {
            Some(age) => format!(
                "<span class=\"heartbeat{}\">{} ago</span>",
                if member.healthy { "" } else { " old" },
                age_text(age)
            ),
            None => "<span class=\"heartbeat old\">never</span>".to_owned(),
        };
        html.push_str(&format!(
            "<tr class=\"member{recovering}\" data-replica=\"{id}\">\
             <td class=\"replica-id\">{id}</td><td class=\"step\">{step}</td><td>{address}</td>\
             <td>{store}</td><td>{world_size}</td><td>{state}</td><td>{heartbeat}</td>",
            recovering = if member.recovering { " recovering" } else { "" },
            step = member.step,
            address = escape(&member.address),
            store = escape(&member.store_address),
            world_size = member.world_size,
        ));
        if joined {
            let joined = member
                .joined_age_ms
                .map(|age| format!("{} ago", age_text(age)))
                .unwrap_or_default();
            html.push_str(&format!("<td>{joined}</td>"));
        }
        html.push_str(&format!(
            "<td><form method=\"post\" action=\"/replica/{path}/kill?token={token}\">\
             <button type=\"submit\" class=\"kill\" data-kill=\"{id}\" title=\"Ask the manager of {id} to exit\">Kill</button>\
             </form></td></tr>\n",
            path = escape(&percent_encode(&member.replica_id)),
            token = escape(&percent_encode(token)),
        ));
    }
    html.push_str("</tbody>\n</table>\n");
}

fn render_heartbeats(html: &mut String, status: &LighthouseStatus, view: &View<'_>) {
    html.push_str("<section id=\"heartbeats\">\n<h2>Heartbeats</h2>\n");
    if status.heartbeats.is_empty() {
        html.push_str("<p class=\"empty\">No heartbeat yet.</p>\n");
    } else {
        html.push_str("<ul class=\"heartbeats\">\n");
        for heartbeat in view.page_of(&status.heartbeats) {
            html.push_str(&format!(
                "<li class=\"heartbeat{}\" data-replica=\"{id}\"><span class=\"replica-id\">{id}</span>: {} ago{}</li>\n",
                if heartbeat.healthy { "" } else { " old" },
                age_text(heartbeat.age_ms),
                if heartbeat.healthy { "" } else { " (expired)" },
                id = escape(&heartbeat.replica_id),
            ));
        }
        html.push_str("</ul>\n");
    }
    html.push_str("</section>\n");
}

fn render_last_kill(html: &mut String, last_kill: Option<&KillOutcome>) {
    let Some(kill) = last_kill else {
        return;
    };
    let text = if kill.ok {
        format!(
            "Last kill: {} (manager {}) acknowledged.",
            escape(&kill.replica_id),
            escape(kill.address.as_deref().unwrap_or("?"))
        )
    } else {
        format!(
            "Last kill: {} failed: {}",
            escape(&kill.replica_id),
            escape(kill.error.as_deref().unwrap_or("unknown error"))
        )
    };
    html.push_str(&format!(
        "<section id=\"last-kill\" class=\"{}\"><p>{text}</p></section>\n",
        if kill.ok { "ok" } else { "failed" }
    ));
}

/// An age in milliseconds as "0.42 s" / "12.3 s" / "5 min".
fn age_text(ms: u64) -> String {
    if ms < 10_000 {
        format!("{}.{:02} s", ms / 1000, (ms % 1000) / 10)
    } else if ms < 120_000 {
        format!("{}.{} s", ms / 1000, (ms % 1000) / 100)
    } else {
        format!("{} min", ms / 60_000)
    }
}

/// Escapes text for HTML element content and double- or single-quoted
/// attribute values.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Percent-encodes a URL path segment: everything but RFC 3986's
/// unreserved characters.
pub(crate) fn percent_encode(segment: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
    }
    out
}

const HEAD: &str = r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Lighthouse Dashboard - Ferry</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<noscript><meta http-equiv="refresh" content="2"></noscript>
<style>
body { margin: 0; font-family: -apple-system, BlinkMacSystemFont, "Segoe UI", Roboto, "Helvetica Neue", Arial, "Noto Sans", sans-serif; font-size: 15px; line-height: 1.45; color: #212529; background: #f6f7f9; }
header { display: flex; align-items: baseline; justify-content: space-between; padding: 14px 20px; background: #1f2d3d; color: #fff; }
header h1 { margin: 0; font-size: 20px; font-weight: 500; }
header .addr { font-family: ui-monospace, monospace; opacity: .8; }
section { max-width: 1240px; margin: 0 auto; padding: 10px 20px; }
h2 { font-size: 17px; font-weight: 500; margin: 10px 0 6px; }
.muted { color: #6c757d; font-weight: 400; }
.summary { display: flex; flex-wrap: wrap; gap: 10px; align-items: stretch; }
.stat { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 8px 16px; min-width: 110px; }
.stat .label { display: block; color: #6c757d; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.stat .value { font-size: 24px; font-weight: 600; }
.next, .options { flex-basis: 100%; margin: 4px 0; }
.next code { white-space: pre-wrap; }
.next.ready strong { color: #1a7f37; }
.next.waiting strong { color: #b35900; }
.options { color: #6c757d; font-size: 13px; }
table.members { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid #dde1e6; }
table.members th, table.members td { text-align: left; padding: 6px 10px; border-bottom: 1px solid #eceff2; }
table.members th { font-size: 12px; color: #6c757d; text-transform: uppercase; letter-spacing: .03em; }
tr.member.recovering { background: #fff1dc; }
.replica-id { font-family: ui-monospace, monospace; }
.badge { display: inline-block; padding: 1px 7px; border-radius: 9px; font-size: 12px; background: #e9ecef; }
.badge.ok { background: #dafbe1; color: #1a7f37; }
.badge.recovering { background: orange; color: #fff; }
.badge.failed { background: #ffe1e1; color: #b00020; }
.heartbeat.old { color: #d00; }
button.kill { background: #c62828; color: #fff; border: 0; border-radius: 4px; padding: 4px 12px; cursor: pointer; }
button.kill:hover { background: #a01818; }
form { margin: 0; }
ul.heartbeats { margin: 0; padding-left: 20px; }
.empty { color: #6c757d; }
#last-kill.failed p, #kill-result.failed { color: #b00020; }
#last-kill.ok p, #kill-result.ok { color: #1a7f37; }
</style>
</head>
<body>
"#;

const SCRIPT: &str = r#"<script>
(function () {
  'use strict';
  function kill(id) {
    var out = document.getElementById('kill-result');
    out.className = '';
    out.textContent = 'Killing ' + id + '\u2026';
    var token = document.querySelector('meta[name="ferry-kill-token"]').getAttribute('content');
    var url = '/replica/' + encodeURIComponent(id) + '/kill?token=' + encodeURIComponent(token);
    var done = fetch(url, { method: 'POST' })
      .then(function (response) { return response.json(); })
      .then(function (outcome) {
        out.className = outcome.ok ? 'ok' : 'failed';
        out.textContent = outcome.ok
          ? 'Killed ' + id + ' (manager ' + outcome.address + ' acknowledged).'
          : 'Kill ' + id + ' failed: ' + outcome.error;
        return outcome;
      })
      .catch(function (err) {
        out.className = 'failed';
        out.textContent = 'Kill ' + id + ' failed: ' + err;
        return { replica_id: id, ok: false, error: String(err) };
      });
    window.ferryLastKill = done;
    return done;
  }
  document.addEventListener('click', function (event) {
    var button = event.target && event.target.closest ? event.target.closest('[data-kill]') : null;
    if (!button) { return; }
    event.preventDefault();
    kill(button.getAttribute('data-kill'));
  });
  function refresh() {
    fetch(window.location.pathname + window.location.search, { cache: 'no-store' })
      .then(function (response) { return response.text(); })
      .then(function (text) {
        var fresh = new DOMParser().parseFromString(text, 'text/html').getElementById('dashboard');
        var current = document.getElementById('dashboard');
        if (fresh && current) { current.replaceWith(fresh); }
      })
      .catch(function () {})
      .then(function () { setTimeout(refresh, 1000); });
  }
  setTimeout(refresh, 1000);
})();
</script>
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup() {
        assert_eq!(
            escape(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn percent_encodes_path_segments() {
        assert_eq!(
            percent_encode("train_ddp_0:uuid-1.2~"),
            "train_ddp_0%3Auuid-1.2~"
        );
        assert_eq!(percent_encode("a/b c"), "a%2Fb%20c");
        assert_eq!(percent_encode("é"), "%C3%A9");
    }

    #[test]
    fn ages() {
        assert_eq!(age_text(420), "0.42 s");
        assert_eq!(age_text(12_345), "12.3 s");
        assert_eq!(age_text(300_000), "5 min");
    }
}
