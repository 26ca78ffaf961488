-- Crash attribution by queue. A mark records the queue of the queue table its delivery came
-- through (NULL: the service without a table), so that a quarantined event is named with its
-- queue, and an operator reading the marks sees which queue's work is crash-looping. The marks
-- stay keyed by event: an event is the culprit whichever queue brought it.
ALTER TABLE consumer_in_progress ADD COLUMN queue text;
