"""Pictures of a recorded schedule: `kvloop trace F --out schedule.png --html schedule.html`."""
