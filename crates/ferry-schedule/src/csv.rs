//! [`Schedule`] and its CSV form, byte-compatible with PyTorch's
//! `_dump_csv` / `_load_csv` (Python's `csv` module defaults): one row per
//! rank, one cell per step, an empty cell for an idle step, rows ended by
//! `\r\n`. The same form holds `compute_only` and `compute_comms` schedules.

use crate::action::{Action, ParseActionError};

/// A schedule: one list of steps per rank, `None` for an idle step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// The steps of every rank, indexed by rank.
    pub ranks: Vec<Vec<Option<Action>>>,
}

/// A CSV text that is not a schedule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CsvError {
    /// A cell is not an action.
    #[error("rank {rank} (CSV row {row}), step {step}: {source}", row = rank + 1)]
    Action {
        /// The rank (0-based row).
        rank: usize,
        /// The step (0-based column).
        step: usize,
        /// Why the cell is not an action.
        #[source]
        source: ParseActionError,
    },
    /// A quoted cell is never closed.
    #[error("rank {rank} (CSV row {row}): a quoted cell is never closed", row = rank + 1)]
    UnclosedQuote {
        /// The rank (0-based row).
        rank: usize,
    },
    /// Text follows a closing quote inside a cell.
    #[error("rank {rank} (CSV row {row}): text follows a closing quote in step {step}; expected ',' or the end of the row", row = rank + 1)]
    AfterQuote {
        /// The rank (0-based row).
        rank: usize,
        /// The step (0-based column).
        step: usize,
    },
}

impl Schedule {
    /// A schedule from its rows.
    pub fn new(ranks: Vec<Vec<Option<Action>>>) -> Schedule {
        Schedule { ranks }
    }

    /// Whether any rank has a send or a receive (a lowered schedule), as
    /// against a compute-only one.
    ///
    /// ```
    /// use ferry_schedule::Schedule;
    ///
    /// assert!(!Schedule::from_csv("0F0,0B0\n")?.has_comms());
    /// assert!(Schedule::from_csv("0F0,0SEND_F0\n1RECV_F0\n")?.has_comms());
    /// # Ok::<(), ferry_schedule::CsvError>(())
    /// ```
    pub fn has_comms(&self) -> bool {
        self.ranks
            .iter()
            .flatten()
            .flatten()
            .any(|a| a.kind().is_comm())
    }

    /// The schedule as PyTorch's `_dump_csv` writes it.
    pub fn to_csv(&self) -> String {
        let mut out = String::new();
        for row in &self.ranks {
            // Python's csv writer quotes a row that is one empty cell, so it
            // is not read back as an empty row.
            if let [None] = row.as_slice() {
                out.push_str("\"\"");
            }
            for (i, slot) in row.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                if let Some(action) = slot {
                    out.push_str(&action.to_string());
                }
            }
            out.push_str("\r\n");
        }
        out
    }

    /// Reads a schedule as PyTorch's `_load_csv` does (Python's `csv`
    /// reader, then `_Action.from_str` on every cell, blank cells idle).
    /// Accepts `\r\n`, `\n` or `\r` row ends and quoted cells.
    pub fn from_csv(text: &str) -> Result<Schedule, CsvError> {
        let mut ranks = Vec::new();
        for (rank, cells) in read_rows(text)?.into_iter().enumerate() {
            let row = cells
                .iter()
                .enumerate()
                .map(|(step, cell)| {
                    Action::parse_slot(cell).map_err(|source| CsvError::Action {
                        rank,
                        step,
                        source,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            ranks.push(row);
        }
        Ok(Schedule { ranks })
    }
}

/// Splits CSV text into rows of cells, Python `csv` dialect `excel`.
fn read_rows(text: &str) -> Result<Vec<Vec<String>>, CsvError> {
    let mut rows = Vec::new();
    let mut chars = text.chars().peekable();
    while chars.peek().is_some() {
        let rank = rows.len();
        let mut row = Vec::new();
        let mut cell = String::new();
        let mut any = false;
        loop {
            match chars.next() {
                None => break,
                Some('\r') => {
                    if chars.peek() == Some(&'\n') {
                        chars.next();
                    }
                    break;
                }
                Some('\n') => break,
                Some(',') => {
                    any = true;
                    row.push(std::mem::take(&mut cell));
                }
                Some('"') if cell.is_empty() => {
                    any = true;
                    loop {
                        match chars.next() {
                            None => return Err(CsvError::UnclosedQuote { rank }),
                            Some('"') if chars.peek() == Some(&'"') => {
                                chars.next();
                                cell.push('"');
                            }
                            Some('"') => break,
                            Some(c) => cell.push(c),
                        }
                    }
                    match chars.peek() {
                        None | Some(',' | '\r' | '\n') => {}
                        Some(_) => {
                            return Err(CsvError::AfterQuote {
                                rank,
                                step: row.len(),
                            })
                        }
                    }
                }
                Some(c) => {
                    any = true;
                    cell.push(c);
                }
            }
        }
        if any || !cell.is_empty() {
            row.push(cell);
        }
        rows.push(row);
    }
    Ok(rows)
}
