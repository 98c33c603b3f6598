//! ferry-schedule's parsers (`Action::from_str`, `Action::parse_slot`,
//! `Schedule::from_csv`) return `Ok` or `Err` on arbitrary bytes, none
//! panics; and whatever parses prints back to text that parses to the same
//! value.
#![no_main]

use ferry_schedule::{Action, Schedule};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(action) = text.parse::<Action>() {
        let printed = action.to_string();
        assert_eq!(
            printed.parse::<Action>().as_ref(),
            Ok(&action),
            "{printed:?}"
        );
    }
    if let Ok(Some(action)) = Action::parse_slot(&text) {
        let printed = action.to_string();
        assert_eq!(
            Action::parse_slot(&printed),
            Ok(Some(action)),
            "{printed:?}"
        );
    }
    if let Ok(schedule) = Schedule::from_csv(&text) {
        let csv = schedule.to_csv();
        assert_eq!(Schedule::from_csv(&csv).as_ref(), Ok(&schedule), "{csv:?}");
        // Printing is a fixed point after one round.
        assert_eq!(schedule.to_csv(), csv);
    }
});
